#include "core/ragged/step_model.h"

#include <algorithm>
#include <cstdio>

#include "core/ragged/int_math.h"

namespace rfsdp {

std::string WireFormat::describe() const {
  std::string w = code_block > 0 ? "codes (1 B) + fp32 scale / " + std::to_string(code_block)
                                 : std::to_string(weight_bytes) + " B weights";
  return w + ", " + std::to_string(grad_bytes) + " B gradients";
}

int64_t gather_bytes(const Plan& plan, const WireFormat& wire) {
  int64_t slice = plan.shard_elems * (wire.code_block > 0 ? 1 : wire.weight_bytes);
  if (wire.code_block > 0) {
    for (int64_t k : block_slots(plan, wire.code_block)) slice += 4 * k;
  }
  return (plan.world_size - 1) * slice;
}

int64_t reduce_bytes(const Plan& plan, const WireFormat& wire, int64_t replicas) {
  return (plan.world_size - 1) * plan.shard_elems * wire.grad_bytes +
         (replicas - 1) * plan.shard_elems * wire.replica_bytes;
}

Fsdp2Unit fsdp2_unit(const std::vector<TensorSpec>& tensors, int64_t world_size) {
  Fsdp2Unit u;
  for (const TensorSpec& t : tensors) {
    const int64_t dim0 = t.shape.empty() ? 1 : t.shape[0];
    u.shard_elems += ceil_div(dim0, world_size) * (t.numel() / dim0);
    u.total_elems += t.numel();
  }
  return u;
}

int64_t fsdp2_copy_bytes(const Fsdp2Unit& unit, int64_t world_size, int64_t weight_bytes,
                         int64_t grad_bytes) {
  const int64_t S = unit.shard_elems;
  return 2 * (S + world_size * S) * weight_bytes + world_size * S * grad_bytes;
}

std::string LinkModel::describe() const {
  char text[400];
  std::snprintf(text, sizeof text,
                "nodes of %lld GPUs; a GPU sends %.0f GB/s inside its node (%.0f us a ring step) "
                "and %.0f GB/s across nodes (%.0f us a ring step); copies at %.0f GB/s",
                static_cast<long long>(node_size), intra_gbps, intra_latency_us, inter_gbps,
                inter_latency_us, hbm_gbps);
  return text;
}

double collective_seconds(int64_t bytes, int64_t world_size, const LinkModel& links) {
  if (world_size <= 1) return 0.0;
  const bool spans_nodes = world_size > links.node_size;
  const double gbps = spans_nodes ? links.inter_gbps : links.intra_gbps;
  const double latency = spans_nodes ? links.inter_latency_us : links.intra_latency_us;
  return static_cast<double>(bytes) / (gbps * 1e9) +
         static_cast<double>(world_size - 1) * latency * 1e-6;
}

double copy_seconds(int64_t bytes, const LinkModel& links) {
  return 2.0 * static_cast<double>(bytes) / (links.hbm_gbps * 1e9);
}

}  // namespace rfsdp
