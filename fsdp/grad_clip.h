// Gradient clipping over sharded units: the global L2 norm from the local
// gradient slices (one all-reduce), then one scaling of the local slices.
#pragma once

#include <vector>

#include "fsdp/fsdp_unit.h"

namespace rfsdp {

// Returns the global norm of all units' gradients (before clipping). When it
// exceeds max_norm, every local gradient is scaled by max_norm / (norm + 1e-6),
// as torch.nn.utils.clip_grad_norm_ does. A non-finite norm throws (naming a
// tensor with non-finite gradients on this rank, if any) and leaves the
// gradients untouched, unless error_if_nonfinite is false. All units must
// share one process group.
double clip_grad_norm(const std::vector<FSDPUnit*>& units, double max_norm,
                      bool error_if_nonfinite = true);

}  // namespace rfsdp
