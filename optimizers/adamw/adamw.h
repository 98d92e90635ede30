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

#include "optimizers/common/param_shard.h"
#include "quant/blockwise/block_layout.h"
#include "quant/blockwise/cpu_kernels.h"

namespace rfsdp {

struct AdamWOptions {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 1e-2;
  // Scan gradients for NaN/Inf before a step and throw (state untouched); with
  // a Comm every rank agrees (StepGate: one all-reduce), so all of them throw together.
  bool check_finite = true;
};

class AdamW {
 public:
  // comm (optional): the ranks that must agree on a NaN/Inf gradient.
  AdamW(std::vector<ParamShard> params, AdamWOptions options = {},
        std::shared_ptr<Comm> comm = nullptr);
  virtual ~AdamW() = default;
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;
  // One step of every parameter that has a gradient (each counts its own steps,
  // as torch.optim.AdamW does). With a Comm, every rank agrees first (StepGate).
  void step();
  // What its errors call it.
  virtual const char* name() const { return "AdamW"; }
  int64_t steps() const { return steps_; }  // calls of step() that stepped
  // Hyperparameters of every parameter; set_param_options overrides one (a
  // parameter group's).
  AdamWOptions& options() { return options_; }
  void set_param_options(size_t i, const AdamWOptions& o);
  // The gradient parameter i steps with; undefined: it takes no step.
  void set_grad(size_t i, const at::Tensor& grad);
  int64_t step_count(size_t i) const { return param_steps_.at(i); }
  void set_step_count(size_t i, int64_t n) { param_steps_.at(i) = n; }
  // The tensors the step updates for parameter i, by name (exp_avg and
  // exp_avg_sq; 8-bit: q1, absmax1, q2, absmax2): a checkpoint saves these.
  virtual std::vector<std::pair<std::string, at::Tensor>> state(size_t i) const;
  const std::vector<ParamShard>& params() const { return params_; }
  // The moments of parameter i, fp32 (dequantised for 8-bit state).
  virtual at::Tensor exp_avg(size_t i) const { return m_.at(i); }
  virtual at::Tensor exp_avg_sq(size_t i) const { return v_.at(i); }
  // Bytes of optimizer state on this rank.
  virtual int64_t state_bytes() const;

 protected:
  // Checks the parameters; fp32 moments only where fp32_state(i) says so.
  AdamW(std::vector<ParamShard> params, AdamWOptions options, std::shared_ptr<Comm> comm,
        const std::vector<bool>& fp32_state);
  // One parameter's step (CPU kernels; AdamW8bit: also its CUDA kernel).
  virtual void update(size_t i, int64_t step);
  // GPU parameters with fp32 moments, all at once (torch's fused AdamW kernel).
  void fused_update(const std::vector<size_t>& params);
  const AdamWOptions& options_of(size_t i) const {
    return has_param_options_[i] ? param_options_[i] : options_;
  }
  void check_grads() const;
  std::vector<ParamShard> params_;
  AdamWOptions options_;
  std::vector<AdamWOptions> param_options_;
  std::vector<bool> has_param_options_;
  std::vector<int64_t> param_steps_;
  std::shared_ptr<Comm> comm_;
  int64_t steps_ = 0;
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
