// The fp32-moment AdamW update of parameter shards (torch.optim.AdamW's
// formula: decoupled weight decay, bias correction), one home for AdamW's and
// Muon's AdamW part: rfsdp's CPU kernel per tensor, or torch's fused
// multi-tensor kernel (every GPU tensor; CPU ones with fused_on_cpu), one
// launch per group, device and dtype.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace rfsdp {

struct AdamWStep {
  at::Tensor param, grad, m, v;  // contiguous; m, v fp32; the CPU kernel: all fp32
  double lr, beta1, beta2, eps, weight_decay;
  int64_t step;   // 1-based (bias correction)
  size_t group;   // tensors of one group (equal hyperparameters) share a fused launch
};

// Applies every update; returns the fused kernel's launches.
int64_t adamw_fp32_steps(const std::vector<AdamWStep>& steps, bool fused_on_cpu);

}  // namespace rfsdp
