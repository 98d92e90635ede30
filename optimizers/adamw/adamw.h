// AdamW and AdamW8bit over parameter shards (whole tensors are one-shard
// cases). The same formula as torch.optim.AdamW: decoupled weight decay, bias
// correction. AdamW8bit keeps both moments as 8-bit block-wise codes (signed
// and unsigned dynamic maps) with one fp32 absmax per block; blocks are defined
// on the global tensor, so a shard must hold whole blocks and the result never
// depends on the world size.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "optimizers/common/sharded_optimizer.h"
#include "quant/blockwise/block_layout.h"
#include "quant/blockwise/cpu_kernels.h"

namespace rfsdp {

struct AdamWOptions {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 1e-2;
  // Scan gradients for NaN/Inf before a step and throw (state untouched); with
  // a Comm every rank agrees (StepGate: one all-reduce), so all of them throw
  // together. The optimizer's, read at construction (not a group's).
  bool check_finite = true;
  // Step CPU parameters with fp32 moments by torch's fused multi-tensor kernel
  // too (what GPU parameters always use), instead of rfsdp's own CPU kernel.
  // The optimizer's, read at construction.
  bool fused_on_cpu = false;
};

class AdamW : public GroupedOptimizer<AdamWOptions> {
 public:
  // comm (optional): the ranks that must agree on a NaN/Inf gradient.
  // options: every group's until set_group_options.
  AdamW(std::vector<ParamShard> params, AdamWOptions options = {},
        std::shared_ptr<Comm> comm = nullptr);
  const char* name() const override { return "AdamW"; }
  // The tensors the step updates for parameter i, by name (exp_avg and
  // exp_avg_sq; 8-bit: q1, absmax1, q2, absmax2): a checkpoint saves these.
  std::vector<std::pair<std::string, at::Tensor>> state(size_t i) const override;
  // The moments of parameter i, fp32 (dequantised for 8-bit state).
  virtual at::Tensor exp_avg(size_t i) const { return m_.at(i); }
  virtual at::Tensor exp_avg_sq(size_t i) const { return v_.at(i); }
  // Bytes of optimizer state on this rank.
  virtual int64_t state_bytes() const;

 protected:
  // Checks the parameters; fp32 moments only where fp32_state(i) says so.
  AdamW(std::vector<ParamShard> params, AdamWOptions options, std::shared_ptr<Comm> comm,
        const std::vector<bool>& fp32_state);
  void run_step(StepGate& gate, const std::vector<size_t>& stepping) override;
  void check_options(const AdamWOptions& o) const override;
  // One parameter's step (CPU kernels; AdamW8bit: also its CUDA kernel).
  virtual void update(size_t i, int64_t step);
  // Parameters with fp32 moments on a GPU (or on the CPU with fused_on_cpu), all
  // at once: torch's fused AdamW kernel, one launch per group, device and dtype.
  void fused_update(const std::vector<size_t>& params);
  bool fused_on_cpu_ = false;
  std::vector<at::Tensor> m_, v_;  // fp32 moments (for AdamW8bit: the small tensors only)
};

class AdamW8bit : public AdamW {
 public:
  // Tensors with fewer than min_8bit_size elements (full tensor, never the
  // shard) keep fp32 moments, as bitsandbytes does.
  AdamW8bit(std::vector<ParamShard> params, AdamWOptions options = {},
            quant::BlockShape block = quant::BlockShape::blocks(256),
            int64_t min_8bit_size = 4096, std::shared_ptr<Comm> comm = nullptr);
  bool is_8bit(size_t i) const { return eight_bit_.at(i); }
  const char* name() const override { return "AdamW8bit"; }
  at::Tensor exp_avg(size_t i) const override;
  at::Tensor exp_avg_sq(size_t i) const override;
  std::vector<std::pair<std::string, at::Tensor>> state(size_t i) const override;
  int64_t state_bytes() const override;
  const quant::BlockShape& block() const { return block_; }

 private:
  struct Quantized8 {
    at::Tensor q1, absmax1, q2, absmax2;
    quant::BlockLayout layout;
  };
  void update(size_t i, int64_t step) override;
  quant::BlockShape block_;
  std::vector<bool> eight_bit_;
  std::vector<Quantized8> q_;
  at::Tensor code1_, code2_;
  at::Tensor code1_on_, code2_on_;  // the codes on the GPU the parameters live on
  std::shared_ptr<const quant::cpu::CodeLut> lut1_, lut2_;
};

}  // namespace rfsdp
