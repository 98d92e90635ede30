#include "core/comm/hybrid_groups.h"

#include <stdexcept>
#include <string>
#include <vector>

namespace rfsdp {

HybridGroups hybrid_groups(Comm& world, int shard_size) {
  const int n = world.size();
  if (shard_size < 1 || n % shard_size != 0) {
    throw std::invalid_argument("hybrid_groups: shard_size " + std::to_string(shard_size) +
                                " must divide the world size " + std::to_string(n) +
                                " (the mesh is world/shard_size replicas x shard_size shards)");
  }
  const int replica = world.rank() / shard_size, shard_rank = world.rank() % shard_size;
  std::vector<int> shard, replicate;
  for (int s = 0; s < shard_size; ++s) shard.push_back(replica * shard_size + s);
  for (int r = 0; r < n / shard_size; ++r) replicate.push_back(r * shard_size + shard_rank);
  // Names are store prefixes: one per group, so that groups never share keys.
  // A barrier around each split: a group's connections are made while no rank is
  // still connecting another group through the same Gloo device (a rank that
  // reached the second split early could dial a peer still in the first; 1 CI run
  // in 4 failed so, with 'connectFullMesh ... Connection closed by peer').
  HybridGroups g;
  world.barrier().wait();
  g.shard = world.split(shard, "rfsdp_shard_" + std::to_string(replica));
  world.barrier().wait();
  g.replicate = world.split(replicate, "rfsdp_replicate_" + std::to_string(shard_rank));
  world.barrier().wait();
  return g;
}

}  // namespace rfsdp
