#include "optimizers/common/finite.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>

namespace rfsdp {

bool all_finite(const float* x, int64_t n) {
  std::atomic<bool> bad{false};
  at::parallel_for(0, n, 1 << 16, [&](int64_t i0, int64_t i1) {
    // x * 0 is 0 for finite x, NaN for NaN and Inf. Independent lanes, so the
    // loop vectorises (one running sum would wait on every add).
    constexpr int kLanes = 16;
    float lane[kLanes] = {};
    int64_t i = i0;
    for (; i + kLanes <= i1; i += kLanes) {
      for (int j = 0; j < kLanes; ++j) lane[j] += x[i + j] * 0.0f;
    }
    float probe = 0.0f;
    for (; i < i1; ++i) probe += x[i] * 0.0f;
    for (int j = 0; j < kLanes; ++j) probe += lane[j];
    if (probe != 0.0f || std::isnan(probe)) bad.store(true, std::memory_order_relaxed);
  });
  return !bad.load();
}

bool all_finite_bf16(const uint16_t* x, int64_t n) {
  std::atomic<bool> bad{false};
  at::parallel_for(0, n, 1 << 16, [&](int64_t i0, int64_t i1) {
    // NaN and Inf are the values whose 8 exponent bits are all set.
    uint16_t any = 0;
    for (int64_t i = i0; i < i1; ++i) any |= static_cast<uint16_t>(((x[i] & 0x7F80) == 0x7F80) ? 1 : 0);
    if (any) bad.store(true, std::memory_order_relaxed);
  });
  return !bad.load();
}

bool tensor_finite(const at::Tensor& t) {
  // A dense tensor in any order (a transposed Newton-Schulz result, say): its
  // elements are the storage run it spans, checked flat.
  if (t.device().is_cpu() && t.is_non_overlapping_and_dense()) {
    if (t.scalar_type() == at::kFloat) return all_finite(t.data_ptr<float>(), t.numel());
    if (t.scalar_type() == at::kBFloat16) {
      return all_finite_bf16(reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()), t.numel());
    }
  }
  return at::isfinite(t).all().item<bool>();
}

}  // namespace rfsdp
