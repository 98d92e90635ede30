#include "optimizers/muon/newton_schulz.h"

#include <algorithm>
#include <stdexcept>

namespace rfsdp {

NsCoefficients NsCoefficients::polar_express() {
  NsCoefficients c;
  c.coefficients = {{8.156554524902461, -22.48329292557795, 15.878769915207462},
                    {4.042929935166739, -2.808917465908714, 0.5000178451051316},
                    {3.8916678022926607, -2.772484153217685, 0.5060648178503393},
                    {3.285753657755655, -2.3681294933425376, 0.46449024233003106},
                    {2.3465413258596377, -1.7097828382687081, 0.42323551169305323}};
  c.norm_scale = 1.02;
  c.eps = 1e-6;
  return c;
}

void NsCoefficients::check_steps(const std::string& who, int steps) const {
  if (coefficients.empty()) throw std::invalid_argument(who + ": ns_coefficients is empty");
  if (coefficients.size() > 1 && steps > static_cast<int>(coefficients.size())) {
    throw std::invalid_argument(who + ": ns_steps=" + std::to_string(steps) + " but ns_coefficients "
                                "has " + std::to_string(coefficients.size()) + " iterations' "
                                "coefficients");
  }
}

at::Tensor newton_schulz_in_dtype(const at::Tensor& g, int steps, at::ScalarType dtype,
                                  const NsCoefficients& ns) {
  if (g.dim() != 2 && g.dim() != 3) {
    throw std::invalid_argument("newton_schulz: needs a matrix or a batch of matrices");
  }
  ns.check_steps("newton_schulz", steps);
  const bool transposed = g.size(-2) > g.size(-1);
  at::Tensor x = g.to(dtype);
  const bool fresh = !x.is_same(g);  // a new tensor (a cast): normalised in place, as torch does
  if (transposed) x = x.transpose(-2, -1);
  if (g.dim() == 2) {
    const at::Tensor norm = x.norm() * ns.norm_scale + ns.eps;
    x = fresh ? x.div_(norm) : x / norm;
    for (int i = 0; i < steps; ++i) {
      const auto [a, b, c] = ns.at(i);
      const at::Tensor A = at::mm(x, x.t());
      const at::Tensor B = at::addmm(A, A, A, /*beta=*/b, /*alpha=*/c);  // b A + c A A
      x = at::addmm(x, B, x, /*beta=*/a, /*alpha=*/1.0);                // a X + B X
    }
  } else {  // the same, one bmm per product for the whole batch
    x = x / (at::linalg_vector_norm(x, 2, {-2, -1}, /*keepdim=*/true) * ns.norm_scale + ns.eps);
    for (int i = 0; i < steps; ++i) {
      const auto [a, b, c] = ns.at(i);
      const at::Tensor A = at::bmm(x, x.transpose(-2, -1));
      const at::Tensor B = at::baddbmm(A, A, A, /*beta=*/b, /*alpha=*/c);
      x = at::baddbmm(x, B, x, /*beta=*/a, /*alpha=*/1.0);
    }
  }
  return transposed ? x.transpose(-2, -1) : x;
}

at::Tensor newton_schulz(const at::Tensor& g, int steps, at::ScalarType dtype,
                         const NsCoefficients& ns) {
  return newton_schulz_in_dtype(g, steps, dtype, ns).to(at::kFloat).contiguous();
}

double newton_schulz_flops(int64_t rows, int64_t cols, int steps) {
  const double n = static_cast<double>(std::min(rows, cols));
  const double N = static_cast<double>(std::max(rows, cols));
  return steps * (4.0 * n * n * N + 2.0 * n * n * n);
}

}  // namespace rfsdp
