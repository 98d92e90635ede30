// torch.optim.AdamW's element update (decoupled weight decay, bias correction),
// written once for the CPU and CUDA kernels: plain C++, host and device.
#pragma once

#include <cmath>
#include <cstdint>

#include "quant/formats/block_layout.h"  // RFSDP_HOST_DEVICE

namespace rfsdp::quant {

struct AdamWHyper {
  float lr, beta1, beta2, eps, weight_decay;
  int64_t step;  // 1-based, for bias correction
};

// The per-step constants of the update (bias corrections in double, once).
struct AdamWCoeffs {
  float decay, b1, one_minus_b1, b2, one_minus_b2, step_size, inv_sqrt_bc2, eps;
};

inline AdamWCoeffs adamw_coeffs(const AdamWHyper& h) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(h.beta1), static_cast<double>(h.step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(h.beta2), static_cast<double>(h.step));
  return {1.0f - h.lr * h.weight_decay,
          h.beta1,
          1.0f - h.beta1,
          h.beta2,
          1.0f - h.beta2,
          static_cast<float>(h.lr / bc1),
          static_cast<float>(1.0 / std::sqrt(bc2)),
          h.eps};
}

// One element: the moments m, v and the parameter p, updated in place in fp32.
RFSDP_HOST_DEVICE inline void adamw_update(float& p, float& m, float& v, float g,
                                           const AdamWCoeffs& c) {
  m = c.b1 * m + c.one_minus_b1 * g;
  v = c.b2 * v + c.one_minus_b2 * g * g;
#if defined(__CUDA_ARCH__)
  const float root = sqrtf(v);
#else
  const float root = std::sqrt(v);
#endif
  p = p * c.decay - c.step_size * (m / (root * c.inv_sqrt_bc2 + c.eps));
}

}  // namespace rfsdp::quant
