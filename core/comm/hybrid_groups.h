// HSDP's two groups over one world group, laid out as FSDP2's 2-D device mesh
// (replicate, shard): rank = replica * shard_size + shard_rank, so a shard group
// is shard_size consecutive ranks and a replica group takes one rank from each.
#pragma once

#include <memory>

#include "core/comm/comm.h"

namespace rfsdp {

struct HybridGroups {
  std::shared_ptr<Comm> shard;      // shard_size ranks: each unit is sharded over these
  std::shared_ptr<Comm> replicate;  // world / shard_size ranks holding equal shards
};

// Collective over `world` (three barriers and two splits): every rank calls it
// with the same shard_size, which
// must divide the world size. shard_size == world size is plain FSDP (replica
// groups of one rank); shard_size == 1 is plain replication (DDP-like).
HybridGroups hybrid_groups(Comm& world, int shard_size);

}  // namespace rfsdp
