// Whether a tensor holds only finite values: the local part of the NaN/Inf
// check every optimizer step runs (StepGate agrees it across ranks).
#pragma once

#include <ATen/ATen.h>

namespace rfsdp {

// True if every one of the n floats is finite (one parallel pass).
bool all_finite(const float* x, int64_t n);

// The same for n bfloat16 values (their bits).
bool all_finite_bf16(const uint16_t* x, int64_t n);

// True if t (any dtype, any device) holds only finite values (fp32 and bf16
// dense CPU tensors, in any dim order, by the passes above).
bool tensor_finite(const at::Tensor& t);

}  // namespace rfsdp
