// Muon's Newton–Schulz iteration: its coefficients, the kernel (one matrix or a
// batch of equal-shape matrices) and its flop count.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace rfsdp {

// Newton–Schulz's coefficients: iteration k computes X <- a X + (b A + c A^2) X
// (A = X X^T) with (a, b, c) = coefficients[k] (one tuple: every iteration; more:
// one per iteration, as many as the steps at least), after X / (norm_scale |X|_F + eps).
struct NsCoefficients {
  std::vector<std::array<double, 3>> coefficients{{3.4445, -4.7750, 2.0315}};
  double norm_scale = 1.0, eps = 1e-7;
  // Keller Jordan's quintic (the default; torch.optim.Muon's), and Polar Express
  // (Amsel et al., arXiv 2505.16932: five per-iteration tuples computed for 5
  // iterations, safety factor 2e-2, cushion 2, as its authors' code gives them;
  // X / (1.02 |X|_F + 1e-6)).
  static NsCoefficients quintic() { return {}; }
  static NsCoefficients polar_express();
  // Throws std::invalid_argument unless `steps` iterations have coefficients.
  void check_steps(const std::string& who, int steps) const;
  const std::array<double, 3>& at(int k) const {
    return coefficients.size() == 1 ? coefficients[0] : coefficients.at(k);
  }
  bool operator==(const NsCoefficients& o) const {
    return coefficients == o.coefficients && norm_scale == o.norm_scale && eps == o.eps;
  }
};

// Newton–Schulz orthogonalisation of one matrix: transposed when rows > cols,
// `steps` iterations of `ns` computed in `dtype`. Returns a float32 matrix of g's
// shape. A 3-D g is a batch of equal-shape matrices, each orthogonalised alone (bmm).
at::Tensor newton_schulz(const at::Tensor& g, int steps, at::ScalarType dtype = at::kFloat,
                         const NsCoefficients& ns = NsCoefficients());
// The same, the result left in `dtype` and possibly a view (transposed): for a
// caller that converts it once anyway (Muon's step, on its way to the parameter).
at::Tensor newton_schulz_in_dtype(const at::Tensor& g, int steps, at::ScalarType dtype,
                                  const NsCoefficients& ns);
// Flops of that (2 per multiply-add): steps * (4 n^2 N + 2 n^3), n = min, N = max.
double newton_schulz_flops(int64_t rows, int64_t cols, int steps);

}  // namespace rfsdp
