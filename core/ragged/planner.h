// The planner: lays one unit's tensors into a flat buffer of m x S elements so
// that no rank boundary cuts a granule, with the smallest S it can find.
#pragma once

#include <cstdint>
#include <vector>

#include "core/ragged/plan.h"
#include "core/ragged/tensor_spec.h"

namespace rfsdp {

// The planner's limits on its inputs (checked by plan_unit and the bounds below:
// std::invalid_argument naming the value and the limit). Far beyond anyone's run
// (the largest trainings use ~1e5 ranks), and small enough that every quantity
// the search and the step model form stays inside int64: a unit must also keep
// m x (its elements, each tensor rounded up to the alignment) x dtype_bytes, the
// largest gathered buffer any S can give (S never exceeds that sum: everything on
// one rank), within kMaxGatherBytes (2^60): at the largest world size, units up to
// 2^36 bytes (64 GiB; a Llama-3 405B layer is 3.3 GB in bf16). Then the costs the
// multi-buffer search compares (m x S x dtype_bytes + buffers x collective_cost_bytes)
// and the step model's bytes (m x S elements x up to 4 bytes on the wire) stay
// below 2^63.
constexpr int64_t kMaxWorldSize = int64_t{1} << 24;           // 16,777,216 ranks
constexpr int64_t kMaxBuffers = 64;                           // PlannerOptions::max_buffers
constexpr int64_t kMaxCollectiveCostBytes = int64_t{1} << 50;  // 1 PiB
constexpr int64_t kMaxAlignBytes = int64_t{1} << 20;          // 1 MiB
constexpr int64_t kMaxGatherBytes = int64_t{1} << 60;

struct PlannerOptions {
  // Units of at most this many tensors are planned over every tensor order,
  // which makes the plan optimal for them (placement per order is exact).
  int exhaustive_max_tensors = 7;
  // Beyond the three fixed orders, this many more (reversed, then seeded
  // shuffles) for units of up to 64 tensors; 8 for larger ones.
  int extra_orders = 64;
  // Candidate S values are tried one by one from the smallest, until about
  // this many tensor placements are spent; then the search switches to
  // doubling steps and bisection.
  int64_t linear_placements = 200000;
  int min_linear_candidates = 64;  // ... but at least this many candidates
  // Several buffers per unit, each with its own S_b and its own collective: at
  // most this many (1: always one buffer). The tensors that must be cut are
  // grouped by granule spacing; every grouping into at most max_buffers buffers
  // (the other tensors joining one of them, or a buffer of their own) is
  // planned, and the plan with the least cost wins, one buffer on ties. Cost:
  // the bytes a rank receives in a gather (m * S * elem_bytes) plus
  // collective_cost_bytes per buffer.
  int64_t max_buffers = 4;
  // A collective's fixed cost as bytes: latency x bandwidth. Measured here (Gloo,
  // 2 processes, per-rank broadcasts: 295 us x 3.2 GB/s = 0.9 MiB); NCCL on
  // InfiniBand is of the same order (20-50 us x 25-50 GB/s = 0.5-2.5 MB).
  int64_t collective_cost_bytes = 1 << 20;
};

// A lower bound on S that accounts for structure, not just size: the smallest
// S >= ceil(sum n / m) (aligned) that also holds the largest granule a cut
// tensor needs, and is a multiple of the granule of every tensor long enough
// (n > 2S) to contain two rank boundaries. A plan with this S is optimal.
int64_t structural_lower_bound(const std::vector<TensorSpec>& tensors, int64_t world_size,
                               int64_t align_bytes = kDefaultAlignBytes);

// A lower bound on S for any plan, of any number of buffers: ceil(sum n / m)
// (aligned), and the largest min(n, granule) over the tensors: a tensor is
// either whole on one rank or cut into whole granules, so some buffer's S_b
// holds one of them. Looser than structural_lower_bound, which holds for one buffer.
int64_t any_buffers_lower_bound(const std::vector<TensorSpec>& tensors, int64_t world_size,
                                int64_t align_bytes = kDefaultAlignBytes);

// Throws std::invalid_argument unless options are within the limits above.
void check_planner_options(const PlannerOptions& options);

// Throws std::invalid_argument (one line, naming the tensor or the value and its
// limit) for bad input: an empty unit, a malformed spec, duplicate names, mixed
// dtype_bytes, a world size, alignment or option outside the limits above, a unit
// too large for its world size (kMaxGatherBytes).
// The plan may hold several buffers (options.max_buffers).
Plan plan_unit(const std::vector<TensorSpec>& tensors, int64_t world_size,
               int64_t align_bytes = kDefaultAlignBytes, const PlannerOptions& options = {});

}  // namespace rfsdp
