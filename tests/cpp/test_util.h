// Helpers shared by the C++ tests: fresh seeds, seeded random tensors, the
// nearest 8-bit code.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <vector>

namespace rfsdp::testing {

// A new seed every run (tests use fresh random inputs); print it on failure.
// RFSDP_TEST_SEED=<printed seed> replays a failure.
inline uint64_t fresh_seed() {
  if (const char* s = std::getenv("RFSDP_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

// Standard normal values, reproducible from (seed, stream): every rank can
// rebuild every other rank's inputs to compute a reference.
inline at::Tensor seeded_randn(at::IntArrayRef shape, uint64_t seed, uint64_t stream,
                               at::ScalarType dtype = at::kFloat) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 1000003ULL + stream);
  return at::randn(shape, gen, at::TensorOptions().dtype(at::kDouble)).to(dtype);
}

// The nearest of the sorted codes to x (ties to the lower), by scanning every
// code; `ambiguous` when x is within `tol` (fp32's rounding of x) of the midpoint
// of two neighbouring codes, where a correct fp32 kernel may pick either.
inline int nearest_code(double x, double tol, const std::vector<double>& code, bool* ambiguous) {
  const int n = static_cast<int>(code.size());
  int best = 0;
  for (int k = 1; k < n; ++k) {
    if (std::fabs(code[k] - x) < std::fabs(code[best] - x)) best = k;
  }
  *ambiguous = false;
  for (int k = 1; k < n; ++k) {
    const double mid = (code[k - 1] + code[k]) / 2;
    if (std::fabs(x - mid) <= tol) *ambiguous = true;
  }
  return best;
}

}  // namespace rfsdp::testing
