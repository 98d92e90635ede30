// Helpers shared by the C++ tests: fresh seeds, seeded random tensors, the
// nearest code, and block-wise codes checked against float64 values.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "quant/ops.h"

namespace rfsdp::testing {

// The float whose bit pattern is b (the kernel tests walk floats by their bits).
inline float float_of(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

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

// Matrix j of a quant::LowbitSquares sequence (codes, absmax) of matrices
// sizes[k] x sizes[k] in order: its code bytes, code indices (n^2; 4-bit ones
// unpacked, low nibble first) and absmax, copied.
struct LowbitSquare {
  at::Tensor raw, idx, absmax;
};
inline LowbitSquare lowbit_square(const at::Tensor& codes, const at::Tensor& absmax,
                                  const std::vector<int64_t>& sizes, size_t j, int bits, int64_t block) {
  int64_t co = 0, ao = 0;
  for (size_t k = 0; k < j; ++k) {
    co += quant::lowbit_code_bytes(sizes[k] * sizes[k], bits);
    ao += quant::lowbit_blocks(sizes[k] * sizes[k], block);
  }
  const int64_t n = sizes.at(j);
  LowbitSquare out;
  out.raw = codes.narrow(0, co, quant::lowbit_code_bytes(n * n, bits)).clone();
  at::Tensor idx = out.raw.to(at::kLong);
  if (bits == 4) idx = at::stack({idx.remainder(16), idx.div(16, "floor")}, 1).reshape(-1);
  out.idx = idx.narrow(0, 0, n * n);
  out.absmax = absmax.narrow(0, ao, quant::lowbit_blocks(n * n, block)).clone();
  return out;
}

// How many codes expect_block_codes compared, and how many it skipped (on a midpoint).
struct CodeCheck {
  int64_t checked = 0, skipped = 0;
};

// Block-wise codes against float64 values: idx (code indices, one per element of
// want, flat), absmax[b] the scale of elements [b block, (b + 1) block). Each
// absmax must be its block's max |want|, each index the nearest of `code` to
// want / absmax, both to a tolerance of rel times the block's max |want| plus
// (per element, where given) tol: how far the computation that made the
// optimizer's fp32 value may put it from want. A value that close to a midpoint
// may take either neighbour and is skipped. Reports at most 5 wrong codes.
inline CodeCheck expect_block_codes(const at::Tensor& idx, const at::Tensor& absmax,
                                    const at::Tensor& want, int64_t block,
                                    const std::vector<double>& code, double rel,
                                    const std::string& where, const at::Tensor& tol = {}) {
  CodeCheck out;
  const at::Tensor w = want.to(at::kDouble).reshape(-1).contiguous();
  const at::Tensor q = idx.to(at::kLong).reshape(-1).contiguous();
  const at::Tensor a = absmax.to(at::kDouble).contiguous();
  const at::Tensor et = tol.defined() ? tol.to(at::kDouble).reshape(-1).contiguous() : at::zeros_like(w);
  EXPECT_EQ(q.numel(), w.numel()) << where;
  EXPECT_EQ(a.numel(), (w.numel() + block - 1) / block) << where;
  const double* wp = w.data_ptr<double>();
  const double* tp = et.data_ptr<double>();
  int wrong = 0;
  for (int64_t b = 0; b < a.numel() && wrong < 5; ++b) {
    const int64_t e0 = b * block, e1 = std::min(e0 + block, w.numel());
    double wa = 0, ta = 0;
    for (int64_t e = e0; e < e1; ++e) wa = std::max(wa, std::fabs(wp[e])), ta = std::max(ta, tp[e]);
    const double got = a.data_ptr<double>()[b];
    EXPECT_NEAR(got, wa, rel * wa + ta) << where << ", absmax of block " << b;
    if (!(got > 0)) continue;
    for (int64_t e = e0; e < e1; ++e) {
      bool amb;
      const int best = nearest_code(wp[e] / got, (rel * wa + tp[e]) / got, code, &amb);
      if (amb) {
        ++out.skipped;
        continue;
      }
      ++out.checked;
      if (q.data_ptr<int64_t>()[e] != best) {
        ADD_FAILURE() << where << ", element " << e << ": code " << q.data_ptr<int64_t>()[e]
                      << ", want " << best << " (" << wp[e] / got << " of the absmax)";
        if (++wrong >= 5) break;
      }
    }
  }
  return out;
}

}  // namespace rfsdp::testing
