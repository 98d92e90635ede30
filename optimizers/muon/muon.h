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
// Matrices of a parameter of full shape s: 2-D, one s0 x s1 matrix; 3-D, an
// expert stack of s0 matrices s1 x s2; more dims, one s0 x (s1*s2*...) matrix.
// 0-D and 1-D parameters are refused (they belong with AdamW).
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/comm/comm.h"
#include "optimizers/common/owner_exchange.h"
#include "optimizers/common/sharded_optimizer.h"
#include "quant/ops.h"

namespace rfsdp {

enum class MuonAdjustLr {
  Original,       // scale the update by max(1, rows/cols)^0.5 (the reference Muon)
  MatchRmsAdamW,  // by 0.2 * sqrt(max(rows, cols)) (Moonlight: reuse AdamW's lr and wd)
};
MuonAdjustLr parse_muon_adjust_lr(const std::string& s);  // "original" | "match_rms_adamw"
double muon_update_scale(int64_t rows, int64_t cols, MuonAdjustLr adjust);

// Newton–Schulz's coefficients: iteration k computes X <- a X + (b A + c A^2) X
// (A = X X^T) with (a, b, c) = coefficients[k] (one tuple: every iteration; more:
// one per iteration, as many as the steps at least), after X / (norm_scale |X|_F + eps).
struct NsCoefficients {
  std::vector<std::array<double, 3>> coefficients{{3.4445, -4.7750, 2.0315}};
  double norm_scale = 1.0, eps = 1e-7;
  // Keller Jordan's quintic (the default; torch.optim.Muon's), and Polar Express
  // (Amsel et al., arXiv 2505.16932: five per-iteration tuples computed for 5
  // iterations, safety factor 2e-2, cushion 2, as its authors' code gives them;
  // X / (1.02 |X|_F + 1e-6)).
  static NsCoefficients quintic() { return {}; }
  static NsCoefficients polar_express();
  // Throws std::invalid_argument unless `steps` iterations have coefficients.
  void check_steps(const std::string& who, int steps) const;
  const std::array<double, 3>& at(int k) const {
    return coefficients.size() == 1 ? coefficients[0] : coefficients.at(k);
  }
  bool operator==(const NsCoefficients& o) const {
    return coefficients == o.coefficients && norm_scale == o.norm_scale && eps == o.eps;
  }
};

// Newton–Schulz orthogonalisation of one matrix: transposed when rows > cols,
// `steps` iterations of `ns` computed in `dtype`. Returns a float32 matrix of g's
// shape. A 3-D g is a batch of equal-shape matrices, each orthogonalised alone (bmm).
at::Tensor newton_schulz(const at::Tensor& g, int steps, at::ScalarType dtype = at::kFloat,
                         const NsCoefficients& ns = NsCoefficients());
// Flops of that (2 per multiply-add): steps * (4 n^2 N + 2 n^3), n = min, N = max.
double newton_schulz_flops(int64_t rows, int64_t cols, int steps);

struct MuonMatrix {
  size_t param = 0;     // index into the layout's parameters
  int64_t offset = 0;   // first element in the full (flattened) parameter
  int64_t rows = 0, cols = 0;
  // Column counts of its logical column blocks (split_dim 1), each orthogonalised
  // alone and scaled by its own rows x columns; empty: the matrix is one block.
  std::vector<int64_t> col_blocks;
  int root = 0;         // the rank that runs Newton–Schulz on it
  double flops = 0;     // Newton–Schulz flops
  bool replicated = false;  // every rank holds it whole: the root gathers nothing
};

// Where every matrix lives and which rank orthogonalises it (its owner in the
// owner exchange, optimizers/common/owner_exchange.h). Built once per set of
// shards, each knowing every rank's rows (gather_rank_rows) where comm has more
// than one rank; collective: the ranks agree that they hold the same
// parameters, rows and Newton-Schulz steps (one all-reduce of a hash; the
// first difference named on every rank).
//
// Root selection: a matrix held by one rank is rooted there; the rest go
// longest-processing-time first (most flops first) to the least-loaded rank,
// ties to the rank holding most of the matrix, then the lowest rank. A
// parameter is replicated when every rank holds all of it (world > 1);
// otherwise the ranks' rows must tile it.
class MuonLayout {
 public:
  // comm may be null: one rank, every shard whole. ns_steps: one per shard.
  // split_sizes (empty, or one per shard; empty: whole matrices): counts along
  // each matrix's rows (split_dims[i] 0, the default; a 3-D stack: each
  // expert's) or columns (split_dims[i] 1: GPT-2's Conv1D fused QKV, stored
  // [in, 3 in], has its heads as column blocks), summing to them, each block its
  // own matrix for Newton–Schulz and the update's scale (heads, a fused QKV's
  // logical matrices). Row blocks are exchange units of their own (a rank
  // holding one whole orthogonalises it there); column blocks span every row, so
  // their matrix is the unit, split on its root. A shard whose plan carries
  // logical blocks (TensorShard::blocks, blocks_dim) takes them where
  // split_sizes gives none; both given and different is an error naming both.
  MuonLayout(Comm* comm, std::vector<TensorShard> shards, std::vector<int> ns_steps,
             std::vector<std::vector<int64_t>> split_sizes = {},
             std::vector<int> split_dims = {});
  // The layout rank 0 of `world` ranks computes from these shards (each with every
  // rank's rows), without a group and so without the ranks' agreement: for
  // planning tools (roots, loads and traffic at world sizes no test runs).
  static MuonLayout planned(int world, std::vector<TensorShard> shards, std::vector<int> ns_steps,
                            std::vector<std::vector<int64_t>> split_sizes = {},
                            std::vector<int> split_dims = {});

  int world() const { return exchange_.world(); }
  int rank() const { return exchange_.rank(); }
  const std::vector<TensorShard>& shards() const { return shards_; }
  int ns_steps(size_t i) const { return ns_steps_.at(i); }
  const std::vector<MuonMatrix>& matrices() const { return matrices_; }
  // The exchange of the matrices (unit k: matrix k, owned by its root).
  const OwnerExchange& exchange() const { return exchange_; }
  // Elements of matrix k on rank r: [begin, end) in the full parameter (empty when begin == end).
  std::pair<int64_t, int64_t> piece(size_t k, int r) const { return exchange_.piece(k, r); }
  // What rank r sends matrix k's root in the gather: its piece, none where the
  // matrix is replicated (the root holds it whole).
  std::pair<int64_t, int64_t> gather_piece(size_t k, int r) const { return exchange_.gather_piece(k, r); }
  bool replicated(size_t param) const { return replicated_.at(param); }
  // Newton–Schulz flops rooted on each rank, and max / mean of them (1 = balanced).
  std::vector<double> rank_flops() const;
  double flop_imbalance() const;
  // Elements this rank sends and receives per step in the gather, and in the
  // scatter (which sends each rank back its pieces, and a replicated matrix
  // whole to every rank but its root): what the all-to-alls move.
  int64_t gather_send_elems() const { return exchange_.gather_send_elems(); }
  int64_t gather_recv_elems() const { return exchange_.gather_recv_elems(); }
  int64_t scatter_send_elems() const { return exchange_.scatter_send_elems(); }
  int64_t scatter_recv_elems() const { return exchange_.scatter_recv_elems(); }

 private:
  MuonLayout(Comm* comm, int world, int rank, std::vector<TensorShard> shards,
             std::vector<int> ns_steps, std::vector<std::vector<int64_t>> split_sizes,
             std::vector<int> split_dims);
  std::vector<TensorShard> shards_;
  std::vector<int> ns_steps_;
  std::vector<std::vector<int64_t>> split_sizes_;
  std::vector<int> split_dims_;
  std::vector<MuonMatrix> matrices_;
  std::vector<bool> replicated_;  // [param]
  OwnerExchange exchange_;
};

// A group's hyperparameters. Its parameters outside Muon (use_muon false: 0-D
// and 1-D ones, embeddings, heads) take AdamW with lr, weight_decay and the
// adam_ fields, as the reference Muon's MuonWithAuxAdam does.
struct MuonHyper {
  double lr = 0.02, momentum = 0.95, weight_decay = 0.0;
  bool nesterov = true;
  MuonAdjustLr adjust_lr = MuonAdjustLr::Original;
  double adam_beta1 = 0.9, adam_beta2 = 0.95, adam_eps = 1e-10;
};

// One Muon step over the layout's parameters from the updates to orthogonalise
// (u[i]: this rank's shard of parameter i, contiguous fp32, set by make_update(i)
// when the step needs it; hyper: one per layout parameter): a parameter whose
// every matrix is held whole here, when not batching, orthogonalised at once (its
// update still in cache); every other matrix gathered to its root (one
// all-to-all), Newton–Schulz there
// (ns_dtype; batch_same_shape: the matrices rooted here with equal shape and
// steps as one batch, one bmm per product), its failures (an error, a result
// that is not finite) recorded in `gate`, then gate.agree() (the caller's other
// checks agreed in the same all-reduce), commit() (the caller's state), the
// results scattered back (one all-to-all) and applied: p <- p (1 - lr wd) - lr o.
// grad_ranks (null: every parameter steps): read after gate.agree(), a layout
// parameter k with grad_ranks[k] == 0 (no rank had its gradient) takes part in
// the exchanges but is not changed, as torch skips a parameter without one.
// Collective when comm is set; a rank whose gate failed before takes part alike.
void muon_step_from_updates(Comm* comm, const MuonLayout& layout,
                            const std::vector<at::Tensor>& params, std::vector<at::Tensor>& u,
                            const std::function<void(size_t)>& make_update,
                            const std::vector<MuonHyper>& hyper, at::ScalarType ns_dtype,
                            const NsCoefficients& ns, bool batch_same_shape, StepGate& gate,
                            const std::function<void()>& commit,
                            const std::vector<int64_t>* grad_ranks = nullptr);

struct MuonOptions {
  MuonHyper hyper;
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
  // momentum_map ("dynamic": bitsandbytes' signed dynamic map, or "linear"), the
  // update computed from the fp32 momentum before it is encoded. 8-bit needs
  // shards of whole blocks (plan with rfsdp.policy.blockwise_8bit(block)) and
  // runs on the CPU.
  at::ScalarType momentum_dtype = at::kFloat;
  int64_t momentum_block = 256;
  std::string momentum_map = "dynamic";
  // The settings (as Python names them) requantized_state moves between.
  static std::vector<std::string> requantizable() {
    return {"momentum_dtype", "momentum_block", "momentum_map"};
  }
};

// Throws std::invalid_argument, naming the setting as Python names it, unless
// o's storage settings are usable (ns_dtype, momentum_dtype, momentum_block,
// momentum_map; the hyperparameters are the groups': check_options).
void check_config(const MuonOptions& o);

// The C++ optimizer: Muon over the parameter shards in use_muon (ParamShard.shape
// must be the full shape), AdamW (fp32 moments) over the others, one step and
// one agreement all-reduce for both (NaN/Inf gradients, Newton–Schulz failures).
// Groups hold MuonHyper (options.hyper: every group's until set_group_options).
class Muon : public GroupedOptimizer<MuonHyper> {
 public:
  // ns_steps: Newton–Schulz steps per parameter (empty: options.ns_steps for
  // all; ignored outside Muon). use_muon (empty: all): which parameters Muon
  // takes. split_sizes (empty, or one per parameter; ignored outside Muon): a
  // parameter's logical blocks along its rows, or columns where split_dims[i] is
  // 1 (MuonLayout). Collective: the layout agrees on every rank's ranges and splits.
  Muon(std::shared_ptr<Comm> comm, std::vector<ParamShard> params, MuonOptions options = {},
       std::vector<int> ns_steps = {}, std::vector<bool> use_muon = {},
       std::vector<std::vector<int64_t>> split_sizes = {}, std::vector<int> split_dims = {});
  const char* name() const override { return "Muon"; }
  // The layout of the Muon parameters (its parameter k: muon_params()[k]).
  const MuonLayout& layout() const { return layout_; }
  const std::vector<size_t>& muon_params() const { return muon_; }
  bool uses_muon(size_t i) const { return in_muon_.at(i) >= 0; }
  const MuonOptions& options() const { return options_; }
  // Parameter i's momentum in fp32 (decoded where it is stored in 8 bits).
  at::Tensor momentum(size_t i) const;
  // The tensors the step updates for parameter i, by name: momentum_buffer
  // (float32 / bfloat16), or momentum_codes (uint8, the shard's shape) and
  // momentum_absmax (one per block of this shard, in order); outside Muon,
  // AdamW's exp_avg and exp_avg_sq.
  std::vector<std::pair<std::string, at::Tensor>> state(size_t i) const override;
  std::vector<StateLayout> state_layout(size_t i) const override;
  // Parameter i's state as this optimizer keeps it, from a checkpoint's whole
  // state of it saved with the momentum storage of `saved` (momentum_codes and
  // momentum_absmax, or momentum_buffer; outside Muon, exp_avg and exp_avg_sq):
  // the momentum decoded whole, this rank's part stored as this optimizer keeps it.
  NamedState requantized_state(size_t i, const MuonOptions& saved, const NamedState& full) const;
  // Muon's update does not depend on the step count (torch.optim.Muon keeps
  // none); AdamW's does.
  bool state_has_step(size_t i) const override { return !uses_muon(i); }

 protected:
  void check_options(const MuonHyper& h) const override;
  void run_step(StepGate& gate, const std::vector<size_t>& stepping) override;
  void clear_state(size_t i) override;
  // A Muon parameter's gradient is checked through its update (CPU): see run_step.
  bool checks_own_gradient(size_t i) const override;

 private:
  // The layout of the Muon parameters (every rank's rows gathered into them
  // first where unknown).
  static MuonLayout layout_of(Comm* comm, std::vector<ParamShard>* params, const MuonOptions& o,
                              std::vector<int> ns_steps, const std::vector<bool>& use_muon,
                              const std::vector<std::vector<int64_t>>& split_sizes,
                              const std::vector<int>& split_dims);
  // Replicated parameters' gradients must agree across the ranks (each matrix's
  // root computes the update every rank applies): one max all-reduce of their
  // sums, and the same error on every rank where they differ (layout order).
  void check_replicated_grads(const std::vector<at::Tensor>& grads) const;
  bool eight_bit() const { return options_.momentum_dtype == at::kByte; }
  quant::BlockLayout block_layout(size_t i) const;

  MuonOptions options_;
  std::vector<size_t> muon_;    // the Muon parameters, in layout order
  std::vector<int64_t> in_muon_;  // [param]: its index in muon_, or -1 (AdamW)
  MuonLayout layout_;
  std::vector<at::Tensor> momenta_;        // [param] float32 / bfloat16: the momentum; 8-bit: its codes
  std::vector<at::Tensor> absmax_;         // [param] 8-bit: per block
  std::vector<at::Tensor> exp_avg_, exp_avg_sq_;  // [param] outside Muon: AdamW's moments
  quant::Codec code_;  // 8-bit: the code map
};

}  // namespace rfsdp
