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

bool all_ranks_finite(Comm* comm, const std::vector<at::Tensor>& tensors) {
  float bad = 0.0f;
  for (const auto& t : tensors) {
    if (t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous()) {
      if (!all_finite(t.data_ptr<float>(), t.numel())) bad = 1.0f;
    } else if (!at::isfinite(t).all().item<bool>()) {
      bad = 1.0f;
    }
  }
  if (comm && comm->size() > 1) {
    const at::Device dev = tensors.empty() ? at::Device(at::kCPU) : tensors[0].device();
    at::Tensor flag = at::full({1}, bad, at::TensorOptions(at::kFloat).device(dev));
    comm->all_reduce(flag, ReduceOp::Sum).wait();
    bad = flag.item<float>();
  }
  return bad == 0.0f;
}

}  // namespace rfsdp
