// Whether tensors hold only finite values on every rank: the check every
// optimizer runs before it changes anything, so that a NaN or Inf on one rank
// stops the step on all of them (a rank that raised alone would leave the others
// waiting in the next collective).
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "core/comm/comm.h"

namespace rfsdp {

// True if every one of the n floats is finite (one parallel pass).
bool all_finite(const float* x, int64_t n);

// True if t (any dtype, any device) holds only finite values.
bool tensor_finite(const at::Tensor& t);

// One all-reduce of a flag over comm (none, or one rank: local only). Device
// tensors are checked on their device, with one host wait for all of them.
bool all_ranks_finite(Comm* comm, const std::vector<at::Tensor>& tensors);

}  // namespace rfsdp
