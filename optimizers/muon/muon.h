// Distributed Muon on ragged shards. Each step, for every matrix of the Muon
// parameters: momentum on the local shard; the shards of the update gathered to
// the matrix's root rank (one all-to-all for all matrices); Newton–Schulz on the
// root; the result scattered back (the reverse all-to-all); the update applied
// locally. A matrix wholly held by one rank is rooted there and moves nothing.
// A parameter every rank holds whole (replicated: DDP, any data-parallel loop,
// equal gradients everywhere) has its matrices spread over the ranks as roots,
// each root's result sent to every other rank (as dion does under DDP): nothing
// is gathered, and every rank ends with the single-device update.
//
// The pieces: newton_schulz.h (the iteration), layout.h (matrices, roots and
// the exchange), step.h (the step over the layout, private), this file (the
// options, the config and the optimizer with its momentum).
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/comm/comm.h"
#include "optimizers/common/sharded_optimizer.h"
#include "optimizers/muon/layout.h"
#include "optimizers/muon/newton_schulz.h"
#include "quant/ops.h"

namespace rfsdp {

enum class MuonAdjustLr {
  Original,       // scale the update by max(1, rows/cols)^0.5 (the reference Muon)
  MatchRmsAdamW,  // by 0.2 * sqrt(max(rows, cols)) (Moonlight: reuse AdamW's lr and wd)
};
MuonAdjustLr parse_muon_adjust_lr(const std::string& s);  // "original" | "match_rms_adamw"
double muon_update_scale(int64_t rows, int64_t cols, MuonAdjustLr adjust);

// A group's hyperparameters. Its parameters outside Muon (use_muon false: 0-D
// and 1-D ones, embeddings, heads) take AdamW with lr, weight_decay and the
// adam_ fields, as the reference Muon's MuonWithAuxAdam does.
struct MuonOptions {
  double lr = 0.02, momentum = 0.95, weight_decay = 0.0;
  bool nesterov = true;
  MuonAdjustLr adjust_lr = MuonAdjustLr::Original;
  double adam_beta1 = 0.9, adam_beta2 = 0.95, adam_eps = 1e-10;
  // Hyperball (MuonH; common/hyperball.h): every Muon parameter keeps its
  // Frobenius norm R (hyperball_radius; 0: its norm when the optimizer first
  // steps it, kept in the state) and takes u = d / |d|_F (d: the update before
  // lr, adjust_lr's scale in it; split blocks and experts share their
  // parameter's R and norms), W <- R (W - lr R u) / |W - lr R u|_F; no weight decay.
  bool hyperball = false;
  double hyperball_radius = 0.0;
  // NorMuon (MuonConfig::normuon): the per-row second moment's beta2 and eps.
  double normuon_beta2 = 0.95, normuon_eps = 1e-8;
};

// Settings that shape the state and the step: one per optimizer.
struct MuonConfig {
  int ns_steps = 5;
  at::ScalarType ns_dtype = at::kFloat;  // bf16 is the usual choice on GPU
  NsCoefficients ns_coefficients;
  // Batched Newton–Schulz for same-shape matrices on a root; unset: on GPUs only
  // (on a CPU one BLAS call already fills the cores, and results stay per matrix).
  std::optional<bool> batch_newton_schulz;
  bool check_finite = true;               // refuse NaN/Inf gradients (all ranks agree)
  // The momentum's storage: float32; bfloat16 (updated in fp32, stored rounded);
  // or at::kByte, 8-bit block-wise codes: blocks of momentum_block elements of
  // the global (flattened) tensor, one fp32 absmax each, the code map
  // momentum_map ("dynamic": bitsandbytes' signed dynamic map, "linear", or
  // "float8_e4m3fn": e4m3 codes of momentum * 448 / absmax, quant/formats/fp8_e4m3.h), the
  // update computed from the fp32 momentum before it is encoded. 8-bit needs
  // shards of whole blocks (plan with rfsdp.policy.blockwise_8bit(block)) and
  // runs on the CPU.
  at::ScalarType momentum_dtype = at::kFloat;
  int64_t momentum_block = 256;
  std::string momentum_map = "dynamic";
  // NorMuon (arXiv 2510.05491): after Newton–Schulz, O (adjust_lr's scale in it)
  // is normalised per row of each block (row blocks, each column block's rows):
  // v <- lerp(v, mean(O^2 over the block's columns), 1 - normuon_beta2),
  // N = O / (sqrt(v) + normuon_eps), N <- N |O|_F / max(|N|_F, 1e-8) per block;
  // then W <- W (1 - lr wd) - lr N. v: one fp32 value per row and block
  // (normuon_v), whatever momentum_dtype is.
  bool normuon = false;
  // The settings (as Python names them) requantized_state moves between.
  static std::vector<std::string> requantizable() {
    return {"momentum_dtype", "momentum_block", "momentum_map"};
  }
};

// Throws std::invalid_argument, naming the setting as Python names it, unless
// c is usable (ns_steps, ns_dtype, momentum_dtype, momentum_block, momentum_map;
// the hyperparameters are the groups': check_options).
void check_config(const MuonConfig& c);

struct MuonPiece;  // (step.h)

// The C++ optimizer: Muon over the parameter shards in use_muon (ParamShard.shape
// must be the full shape), AdamW (fp32 moments) over the others, one step and
// one agreement all-reduce for both (NaN/Inf gradients, Newton–Schulz failures).
// Groups hold MuonOptions (options: every group's until set_group_options).
class Muon : public GroupedOptimizer<MuonOptions> {
 public:
  // ns_steps: Newton–Schulz steps per parameter (empty: config.ns_steps for
  // all; ignored outside Muon). use_muon (empty: all): which parameters Muon
  // takes. split_sizes (empty, or one per parameter; ignored outside Muon): a
  // parameter's logical blocks along its rows, or columns where split_dims[i] is
  // 1 (MuonLayout). Collective: the layout agrees on every rank's ranges and splits.
  Muon(std::vector<ParamShard> params, MuonOptions options = {}, MuonConfig config = {},
       std::shared_ptr<Comm> comm = nullptr, std::vector<int> ns_steps = {},
       std::vector<bool> use_muon = {}, std::vector<std::vector<int64_t>> split_sizes = {},
       std::vector<int> split_dims = {});
  const char* name() const override { return "Muon"; }
  // The layout of the Muon parameters (its parameter k: muon_params()[k]).
  const MuonLayout& layout() const { return layout_; }
  const std::vector<size_t>& muon_params() const { return muon_; }
  bool uses_muon(size_t i) const { return in_muon_.at(i) >= 0; }
  const MuonConfig& config() const { return config_; }
  // Parameter i's momentum in fp32 (decoded where it is stored in 8 bits).
  at::Tensor momentum(size_t i) const;
  // The tensors the step updates for parameter i, by name: momentum_buffer
  // (float32 / bfloat16), or momentum_codes (uint8, the shard's shape) and
  // momentum_absmax (one per block of this shard, in order); outside Muon,
  // AdamW's exp_avg and exp_avg_sq. NorMuon: normuon_v (fp32, this rank's rows
  // of each block, in order). Hyperball groups: hyperball_radius (fp32 [1]; 0
  // until the first step sets it).
  std::vector<std::pair<std::string, at::Tensor>> state(size_t i) const override;
  std::vector<StateLayout> state_layout(size_t i) const override;
  // Parameter i's state as this optimizer keeps it, from a checkpoint's whole
  // state of it saved with the momentum storage of `saved` (momentum_codes and
  // momentum_absmax, or momentum_buffer; outside Muon, exp_avg and exp_avg_sq):
  // the momentum decoded whole, this rank's part stored as this optimizer keeps it.
  NamedState requantized_state(size_t i, const MuonConfig& saved, const NamedState& full) const;
  // Muon's update does not depend on the step count (torch.optim.Muon keeps
  // none); AdamW's does.
  bool state_has_step(size_t i) const override { return !uses_muon(i); }
  // Tests only (fault injection): parameter i's matrices skip Newton–Schulz, so the
  // tests see the step refuse to apply an update no Newton–Schulz made.
  void skip_newton_schulz_for_test(size_t i, bool skip);

 protected:
  void check_options(const MuonOptions& o) const override;
  void run_step(StepGate& gate, const std::vector<size_t>& stepping) override;
  void clear_state(size_t i) override;
  // A Muon parameter's gradient is checked through its update (CPU): see run_step.
  bool checks_own_gradient(size_t i) const override;

 private:
  // The layout of the Muon parameters (every rank's rows gathered into them
  // first where unknown).
  static MuonLayout layout_of(Comm* comm, std::vector<ParamShard>* params, const MuonConfig& c,
                              std::vector<int> ns_steps, const std::vector<bool>& use_muon,
                              const std::vector<std::vector<int64_t>>& split_sizes,
                              const std::vector<int>& split_dims);
  // Replicated parameters' gradients must agree across the ranks (each matrix's
  // root computes the update every rank applies): one max all-reduce of their
  // sums, and the same error on every rank where they differ (layout order).
  void check_replicated_grads(const std::vector<at::Tensor>& grads) const;
  bool eight_bit() const { return config_.momentum_dtype == at::kByte; }
  quant::BlockLayout block_layout(size_t i) const;
  bool hyperball_of(size_t i) const { return uses_muon(i) && options_of(i).hyperball; }
  // NorMuon's v entries per row of parameter i's matrices (its column blocks, or 1),
  // the row length of its matrices, and this rank's first entry in the global sequence.
  int64_t v_per_row(size_t i) const;
  int64_t matrix_cols(size_t i) const;
  // After Newton–Schulz, the Muon parameters' pieces here (normalised.cpp):
  // NorMuon's rows, then Hyperball or the plain update, every cut parameter's
  // sums in one all-reduce.
  void apply_normalised(std::vector<MuonPiece>& pieces, const std::vector<MuonOptions>& options,
                        const std::vector<int64_t>& grad_ranks);
  // NorMuon's and Hyperball's state names of parameter i (a Muon one).
  std::vector<std::string> extra_state_names(size_t i) const;

  MuonConfig config_;
  std::vector<size_t> muon_;    // the Muon parameters, in layout order
  std::vector<int64_t> in_muon_;  // [param]: its index in muon_, or -1 (AdamW)
  MuonLayout layout_;
  std::vector<at::Tensor> momenta_;        // [param] float32 / bfloat16: the momentum; 8-bit: its codes
  std::vector<at::Tensor> absmax_;         // [param] 8-bit: per block
  std::vector<at::Tensor> exp_avg_, exp_avg_sq_;  // [param] outside Muon: AdamW's moments
  quant::Codec code_;  // 8-bit: the code map
  std::vector<char> skip_ns_for_test_;  // [layout parameter]: skip_newton_schulz_for_test
  std::vector<at::Tensor> normuon_v_;  // [param] NorMuon: per row and block
  std::vector<at::Tensor> radius_;     // [param] Muon parameters: Hyperball's R (0: not yet set)
  int64_t normalise_bytes_ = 0;        // the last step's Hyperball / NorMuon all-reduce

 public:
  // Bytes this rank sent in the last step's all-reduce of Hyperball's and
  // NorMuon's sums (0: no parameter was cut, or neither applies).
  int64_t normalise_bytes() const { return normalise_bytes_; }
};

}  // namespace rfsdp
