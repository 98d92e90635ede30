// AdamW and AdamW8bit over parameter shards (whole tensors are one-shard
// cases). The same formula as torch.optim.AdamW: decoupled weight decay, bias
// correction. AdamW8bit keeps both moments as 8-bit block-wise codes (signed
// and unsigned dynamic maps) with one fp32 absmax per block; blocks are defined
// on the global tensor, so the result never depends on the world size. A block
// that a shard boundary cuts (torch FSDP2's row chunks do) is shared: each of
// its ranks keeps its elements' codes and a copy of its absmax, and the ranks
// agree the new absmax (the max over theirs) in one all-reduce for all shared
// blocks of a step, so codes and scales equal the one-device ones bit for bit.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "optimizers/common/sharded_optimizer.h"
#include "quant/ops.h"

namespace rfsdp {

struct AdamWOptions {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 1e-2;
  // Hyperball (AdamH; common/hyperball.h) for the group's parameters of 2 or
  // more dims: d = m^ / (sqrt(v^) + eps) (the update before lr), u = d / |d|_F,
  // W <- R (W - lr R u) / |W - lr R u|_F with R hyperball_radius (0: the
  // parameter's norm when it first steps, kept in the state); no weight decay.
  bool hyperball = false;
  double hyperball_radius = 0.0;
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
  std::vector<StateLayout> state_layout(size_t i) const override;
  // The moments of parameter i, fp32 (dequantised for 8-bit state).
  virtual at::Tensor exp_avg(size_t i) const { return m_.at(i); }
  virtual at::Tensor exp_avg_sq(size_t i) const { return v_.at(i); }

 protected:
  // Checks the parameters; fp32 moments only where fp32_state(i) says so.
  AdamW(std::vector<ParamShard> params, AdamWOptions options, std::shared_ptr<Comm> comm,
        const std::vector<bool>& fp32_state);
  void run_step(StepGate& gate, const std::vector<size_t>& stepping) override;
  void check_options(const AdamWOptions& o) const override;
  void clear_state(size_t i) override;
  // One step of a parameter without fp32 moments (AdamW8bit's codes: its CPU
  // and CUDA kernels); those with fp32 moments take adamw_fp32_steps.
  virtual void update(size_t i, int64_t step);
  // The updates of the parameters in `stepping` (after the gate agreed).
  void update_params(const std::vector<size_t>& stepping);
  // Every update of `stepping` after the gate (AdamW8bit: its shared blocks' too).
  virtual void step_params(const std::vector<size_t>& stepping) { update_params(stepping); }
  // The step after the gate: step_params, with Hyperball's parameters taking
  // their direction into a scratch buffer first (lr 1, no decay) and then
  // their projection (every cut one's sums in one all-reduce).
  void step_with_hyperball(const std::vector<size_t>& stepping);
  bool hyperball_of(size_t i) const {
    return options_of(i).hyperball && params_.at(i).shape.size() >= 2;
  }
  // Hyperball's radius (when its group has hyperball) after `out`'s states.
  void add_radius(size_t i, std::vector<std::pair<std::string, at::Tensor>>* out) const;
  void add_radius_layout(size_t i, std::vector<StateLayout>* out) const;
  std::vector<at::Tensor> radius_;  // [param] fp32 [1]: Hyperball's R (0: not yet set)
  bool rank_rows_known_ = false;
  bool fused_on_cpu_ = false;
  std::vector<at::Tensor> m_, v_;  // fp32 moments (for AdamW8bit: the small tensors only)
  int64_t hyperball_bytes_ = 0;

 public:
  // Bytes this rank sent in the last step's all-reduce of Hyperball's sums.
  int64_t hyperball_bytes() const { return hyperball_bytes_; }
};

// AdamW8bit's settings that shape its state.
struct AdamW8bitConfig {
  quant::BlockShape block = quant::BlockShape::blocks(256);
  // Tensors with fewer elements (the full tensor's) keep fp32 moments.
  int64_t min_8bit_size = 4096;
  // How both moments are coded: the dynamic maps (bitsandbytes' numerics) or
  // float8_e4m3fn codes (quant/formats/fp8_e4m3.h; same blocks, same absmax).
  quant::StateFormat state_format = quant::StateFormat::kDynamic;
  // The settings (as Python names them) requantized_state moves between.
  static std::vector<std::string> requantizable() {
    return {"block", "min_8bit_size", "state_format"};
  }
};

class AdamW8bit : public AdamW {
 public:
  // Tensors with fewer than min_8bit_size elements (full tensor, never the
  // shard) keep fp32 moments, as bitsandbytes does.
  AdamW8bit(std::vector<ParamShard> params, AdamWOptions options = {}, AdamW8bitConfig config = {},
            std::shared_ptr<Comm> comm = nullptr);
  bool is_8bit(size_t i) const { return eight_bit_.at(i); }
  const char* name() const override { return "AdamW8bit"; }
  at::Tensor exp_avg(size_t i) const override;
  at::Tensor exp_avg_sq(size_t i) const override;
  std::vector<std::pair<std::string, at::Tensor>> state(size_t i) const override;
  std::vector<StateLayout> state_layout(size_t i) const override;
  const quant::BlockShape& block() const { return block_; }
  quant::StateFormat state_format() const { return format_; }
 protected:
  void clear_state(size_t i) override;

 public:
  // Parameter i's state as this optimizer keeps it, from a checkpoint's whole
  // state of it saved with the blocks of `saved` (q1, absmax1, q2, absmax2;
  // or fp32 exp_avg, exp_avg_sq where it kept those): the moments decoded, this
  // rank's part encoded with this optimizer's blocks (or kept fp32).
  NamedState requantized_state(size_t i, const AdamW8bitConfig& saved, const NamedState& full) const;
  // Where parameter i's absmax entries lie among the global tensor's blocks: the
  // number of blocks of the global tensor, the global index of its first entry,
  // and how many leading entries are blocks that start on an earlier rank (a
  // checkpoint writes a shared block once, from the rank where it starts).
  struct BlockSpan {
    int64_t global_blocks = 0, first = 0, shared_head = 0;
  };
  BlockSpan block_span(size_t i) const { return q_.at(i).span; }
  // Blocks this rank shares with others (cut by a shard boundary), all parameters.
  int64_t shared_blocks() const;

 private:
  // A run of the shard's blocks (local elements from `elem`, absmax entries from
  // `block`): whole blocks, or the blocks of one cut unit (a 1-D block, or a row
  // of tiles), agreed with the other ranks at entry `agreed` on.
  struct Region {
    int64_t elem = 0, block = 0;
    quant::BlockLayout layout;
    int64_t agreed = -1;  // -1: whole blocks
  };
  struct Quantized8 {
    at::Tensor q1, absmax1, q2, absmax2;
    std::vector<Region> regions;
    BlockSpan span;
  };
  void run_step(StepGate& gate, const std::vector<size_t>& stepping) override;
  void step_params(const std::vector<size_t>& stepping) override;
  void update(size_t i, int64_t step) override;
  // Parameter i's first (m) or second (v) moment, fp32, from its codes.
  at::Tensor dequantized(size_t i, bool second) const;
  // The regions of parameter i's shard, and (cut_offset on) the agreed entries
  // of its cut blocks; returns how many it has globally.
  int64_t lay_out(size_t i, int64_t cut_offset);
  // Codes' and scales' layouts of parameter i held in column parts: runs of the
  // global sequences (its rows' segments are not contiguous there).
  void column_parts_layout(size_t i, std::vector<StateLayout>* out) const;
  // The shared blocks' step (collective over comm_ when any exist anywhere).
  void step_shared_blocks(const std::vector<size_t>& stepping);
  int64_t agreed_entries_ = 0;        // shared blocks over all ranks and parameters
  std::vector<size_t> shared_owner_;  // each agreed entry's parameter
  quant::BlockShape block_;
  quant::StateFormat format_;
  std::vector<bool> eight_bit_;
  std::vector<Quantized8> q_;
  quant::Codec code1_, code2_;  // m: signed; v: unsigned, keep_nonzero (in format_)
};

}  // namespace rfsdp
