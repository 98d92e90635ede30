// Whether a tensor holds only finite values: the local part of the NaN/Inf
// check every optimizer step runs (StepGate agrees it across ranks).
#pragma once

#include <ATen/ATen.h>

namespace rfsdp {

// True if every one of the n floats is finite (one parallel pass).
bool all_finite(const float* x, int64_t n);

// True if t (any dtype, any device) holds only finite values.
bool tensor_finite(const at::Tensor& t);

}  // namespace rfsdp
