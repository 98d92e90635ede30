// Helpers shared by the C++ tests: fresh seeds and seeded random tensors.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstdint>
#include <cstdlib>
#include <random>

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

}  // namespace rfsdp::testing
