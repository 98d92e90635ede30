#include "core/comm/hybrid_groups.h"

#include <stdexcept>
#include <string>
#include <vector>

namespace rfsdp {

HybridGroups hybrid_groups(const Comm& world, int shard_size) {
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
  HybridGroups g;
  g.shard = world.split(shard, "rfsdp_shard_" + std::to_string(replica));
  g.replicate = world.split(replicate, "rfsdp_replicate_" + std::to_string(shard_rank));
  return g;
}

}  // namespace rfsdp
