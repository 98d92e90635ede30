#include "optimizers/common/finite.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>
#include <map>
#include <string>
#include <utility>

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

bool tensor_finite(const at::Tensor& t) {
  if (t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous()) {
    return all_finite(t.data_ptr<float>(), t.numel());
  }
  return at::isfinite(t).all().item<bool>();
}

bool all_ranks_finite(Comm* comm, const std::vector<at::Tensor>& tensors) {
  // CPU tensors are scanned here. Device tensors go through torch's AMP check (the
  // one GradScaler relies on: one multi-tensor kernel per device and dtype sets a
  // flag for any NaN or Inf; it also scales by 1, which changes no value), so the
  // host waits once, for the flag.
  float bad = 0.0f;
  std::map<std::pair<std::string, at::ScalarType>, std::vector<at::Tensor>> on_device;
  for (const auto& t : tensors) {
    if (t.device().is_cpu()) {
      if (!tensor_finite(t)) bad = 1.0f;
    } else if (t.numel() > 0) {
      on_device[{t.device().str(), t.scalar_type()}].push_back(t);
    }
  }
  const bool shared = comm && comm->size() > 1;
  if (!shared && on_device.empty()) return bad == 0.0f;
  const at::Device dev =
      shared ? comm->control_device() : on_device.begin()->second.front().device();
  at::Tensor flag = at::full({1}, bad, at::TensorOptions(at::kFloat).device(dev));
  for (auto& [key, ts] : on_device) {
    const auto f32 = at::TensorOptions(at::kFloat).device(ts.front().device());
    at::Tensor found = at::zeros({1}, f32);
    at::_amp_foreach_non_finite_check_and_unscale_(ts, found, at::ones({1}, f32));
    flag.add_(found.to(dev));
  }
  if (shared) comm->all_reduce(flag, ReduceOp::Sum).wait();
  return flag.item<float>() == 0.0f;
}

}  // namespace rfsdp
