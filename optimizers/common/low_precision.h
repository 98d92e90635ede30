// Parameters stored in bfloat16 or float16. Every optimizer keeps fp32 state and
// computes in fp32, as torch's optimizers do for such parameters: a step runs
// on fp32 copies of the parameters (exact), then writes them back rounded to the
// parameter's dtype, to nearest (even) or stochastically (unbiased: E[result]
// is the fp32 value). No fp32 copy outlives the step: the parameter is the
// only master.
//
// Stochastic rounding draws its noise from a hash of (seed, salt, counter,
// element index in the global tensor), not from a generator: the result does
// not depend on the world size or on which rank rounds an element, and
// replicas (DDP, HSDP) round alike. ATen operations only: every device.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

namespace rfsdp {

enum class Rounding { kNearest, kStochastic };
Rounding parse_rounding(const std::string& s);  // "nearest" | "stochastic"

// The dtypes a parameter may have: float32, bfloat16, float16.
bool is_parameter_dtype(at::ScalarType t);
// bfloat16 or float16: stepped through an fp32 copy.
bool is_low_precision(at::ScalarType t);

// dst (bfloat16 or float16) <- x (float32, as many elements; both contiguous),
// rounded as r says. Stochastic: element k's noise is hash(seed, salt, counter,
// first + k), uniform in [0, 1) with 24 bits.
void round_into(const at::Tensor& dst, const at::Tensor& x, Rounding r, uint64_t seed,
                uint64_t salt, int64_t counter, int64_t first);

// The noise round_into draws for elements [first, first + n): float32 in [0, 1).
at::Tensor rounding_noise(uint64_t seed, uint64_t salt, int64_t counter, int64_t first, int64_t n,
                          const at::TensorOptions& on);

}  // namespace rfsdp
