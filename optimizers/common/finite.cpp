#include "optimizers/common/finite.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>

namespace rfsdp {

bool all_finite(const float* x, int64_t n) {
  std::atomic<bool> bad{false};
  at::parallel_for(0, n, 1 << 16, [&](int64_t i0, int64_t i1) {
    float probe = 0.0f;  // x * 0 is 0 for finite x, NaN for NaN and Inf
    for (int64_t i = i0; i < i1; ++i) probe += x[i] * 0.0f;
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
