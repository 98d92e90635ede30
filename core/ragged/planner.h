// The planner: lays one unit's tensors into a flat buffer of m x S elements so
// that no rank boundary cuts a granule, with the smallest S it can find.
#pragma once

#include <cstdint>
#include <vector>

#include "core/ragged/plan.h"
#include "core/ragged/tensor_spec.h"

namespace rfsdp {

struct PlannerOptions {
  // Units of at most this many tensors are planned over every tensor order,
  // which makes the plan optimal for them (placement per order is exact).
  int exhaustive_max_tensors = 7;
  // Candidate S values are tried one by one from the smallest, until about
  // this many tensor placements are spent (at least 64 candidates); then the
  // search switches to doubling steps and bisection.
  // Beyond the three fixed orders, this many more (reversed, then seeded
  // shuffles) for units of up to 64 tensors; 8 for larger ones.
  int extra_orders = 64;
  int64_t linear_placements = 200000;
};

// A lower bound on S that accounts for structure, not just size: the smallest
// S >= ceil(sum n / m) (aligned) that also holds the largest granule a cut
// tensor needs, and is a multiple of the granule of every tensor long enough
// (n > 2S) to contain two rank boundaries. A plan with this S is optimal.
int64_t structural_lower_bound(const std::vector<TensorSpec>& tensors, int64_t world_size,
                               int64_t align_bytes = 16);

// Throws std::invalid_argument (one line, naming the tensor) for bad input:
// an empty unit, a malformed spec, duplicate names, mixed dtype_bytes, m < 1.
Plan plan_unit(const std::vector<TensorSpec>& tensors, int64_t world_size,
               int64_t align_bytes = 16, const PlannerOptions& options = {});

}  // namespace rfsdp
