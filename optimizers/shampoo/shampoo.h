// Block Shampoo with Adam grafting (DistributedShampoo's algorithm) over ragged
// shards. Every matrix of a parameter is cut into tiles of at most B x B (B =
// max_preconditioner_dim; optimizers/common/tiles.h); the planner's
// Shampoo granule keeps every tile whole on one rank, so each rank keeps and
// inverts the factors of its own tiles: the sharded step is the single-device
// step, and nothing but the NaN/Inf flag is communicated. Where shard
// boundaries cut a row of tiles (torch FSDP2's chunk rows, a plan without the
// granule), the rank holding the row's first element owns it (CutTileRow): the
// owner exchange (optimizers/common/owner_exchange.h) brings it the other
// holders' gradient rows before the gate and their M^ and D rows after it, and
// sends them their rows of the update back (three all-to-alls a step for all
// such rows).
//
// Per parameter with gradient g (t: its step count from 1):
//   V <- b2g V + (1 - b2g) g^2;  M <- b1 M + (1 - b1) g;  M^ = M / (1 - b1^t)
//   D = M^ / (sqrt(V / (1 - b2g^t)) + eps_g)                     (Adam's direction)
// and per tile of it, with G the tile of g:
//   L <- b2 L + c G G^T;  R <- b2 R + c G^T G   (c = 1 - b2, or 1 when b2 = 1)
//   when t % frequency == 0: L^-1/4, R^-1/4 of A = L / (1 - b2^t) + eps I (bias
//   correction optional) by symmetric eigendecomposition in fp32 (retried in
//   fp64 where it does not converge or is not finite), its eigenvalues treated
//   as the rank_deficient rule says (see RankDeficient); a root that fails
//   keeps the previous one (identity at first), and three failures in a row on
//   one tile are an error naming the tensor and the tile
//   when t >= start: P = L^-1/4 M^ R^-1/4 scaled to |D|_F (D where |P| = 0), else P = D
//   X <- X (1 - lr wd) - lr P
// Parameters that are not preconditioned (1-D ones, use_shampoo=False groups)
// take D alone: AdamW.
//
// A step changes nothing until every rank agreed that it can be taken (StepGate:
// NaN/Inf gradients, root failures, errors, on any rank): the roots are computed
// first, from the factors the step would store.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/comm/comm.h"
#include "optimizers/common/cut_rows.h"
#include "optimizers/common/eigen.h"
#include "optimizers/common/owner_exchange.h"
#include "optimizers/common/sharded_optimizer.h"
#include "optimizers/common/tiles.h"
#include "quant/ops.h"

namespace rfsdp {

// Hyperparameters a parameter group may set.
struct ShampooOptions {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, epsilon = 1e-12;
  double grafting_beta2 = 0.999, grafting_epsilon = 1e-8, weight_decay = 0.0;
};

// Settings that shape the state: one per optimizer.
struct ShampooConfig {
  int64_t max_preconditioner_dim = 1024;
  int precondition_frequency = 20;
  int start_preconditioning_step = 20;
  bool use_bias_correction = true;
  at::ScalarType factor_dtype = at::kFloat;  // of L, R and the roots (compute: fp32)
  bool check_finite = true;                   // NaN/Inf gradients: every rank throws
  RankDeficient rank_deficient = RankDeficient::Shift;
  // PseudoInverse's threshold relative to l_max; < 0: n * eps(float32) for an n x n
  // factor (torch.linalg.matrix_rank's default tolerance).
  double rank_rtol = -1.0;
  // basis coded (8 or 4 bits): each root A^-1/4 = Q diag(s) Q^T kept as Q's
  // block-wise codes (LowbitSquares: blocks of the n x n eigenvector matrix, row
  // by row, one fp32 absmax each; "linear_square" is the 4-bit Shampoo paper's
  // map) and s in fp32 (the rule's l^-1/4, 0 where it drops l). Every step that
  // preconditions rebuilds the root from Q dequantised and rectified by Björck
  // steps. Not coded: packed roots in factor_dtype.
  quant::LowBitFormat basis;
  // The settings (as Python names them) requantized_state moves between.
  static std::vector<std::string> requantizable() {
    return {"basis_dtype", "basis_block", "basis_map", "bjorck_iterations"};
  }
};

// Throws std::invalid_argument, naming the setting as Python names it, unless c
// is usable.
void check_config(const ShampooConfig& c);

class Shampoo : public GroupedOptimizer<ShampooOptions> {
 public:
  // precondition[i] false: parameter i takes Adam's direction alone (1-D
  // parameters always do). comm: the ranks that agree on NaN/Inf gradients.
  // options: every group's until set_group_options.
  Shampoo(std::vector<ParamShard> params, ShampooOptions options = {}, ShampooConfig config = {},
          std::shared_ptr<Comm> comm = nullptr, std::vector<bool> precondition = {});

  const char* name() const override { return "Shampoo"; }
  const ShampooConfig& config() const { return config_; }
  // The tensors the step updates for parameter i, by name: exp_avg (M),
  // exp_avg_sq (V), and for a preconditioned one factor_left, factor_right,
  // root_left, root_right (its tiles' matrices, packed upper triangles in tile
  // order), or with quantised bases root_left_basis_codes, root_left_basis_absmax,
  // root_left_eigenvalues (s, n per tile) and their root_right_ twins; and
  // root_failures (failures in a row, per tile).
  std::vector<std::pair<std::string, at::Tensor>> state(size_t i) const override;
  std::vector<StateLayout> state_layout(size_t i) const override;

  // Parameter i's state as this optimizer keeps it, from a checkpoint's whole
  // state of it saved by a Shampoo with the root storage of `saved` (its basis
  // format): each root of this rank's tiles as the saved optimizer used it (Q
  // decoded and rectified, with its s; or the packed root, whose eigh gives Q and
  // s), then stored as this one keeps it; every other state this rank's part.
  NamedState requantized_state(size_t i, const ShampooConfig& saved, const NamedState& full) const;
  const std::vector<Tile>& tiles() const { return tiles_; }
  // Rows of tiles that shard boundaries cut (over all ranks).
  const std::vector<CutTileRow>& cut_rows() const { return cut_; }
  bool preconditioned(size_t i) const { return precondition_.at(i); }
  // Tile j (of parameter i's tiles) of its inverse root on one side, full fp32,
  // as a step uses it (rebuilt from its codes and s where quantised).
  at::Tensor root(size_t i, size_t j, bool left) const;
  // Measurements for benches: seconds spent computing roots, root computations
  // retried in fp64, bytes of factors and roots (codes, scales and s where
  // quantised), root flops (about 9 b^3 per b x b eigendecomposition and root)
  // per step that computes them.
  double root_seconds() const { return root_seconds_; }
  int64_t fp64_retries() const { return fp64_retries_; }
  int64_t factor_bytes() const;
  double root_flops() const;

 private:
  struct ParamState {
    at::Tensor m, v;                          // fp32, the shard's shape
    at::Tensor left, right, root_l, root_r;   // flat factor storage (factor_dtype)
    quant::LowbitSquares q_l, q_r;            // or (basis coded) the roots' Q codes, by tile,
    at::Tensor s_l, s_r;                      // and their s (fp32, n per tile)
    std::vector<int64_t> sl, sr;              // each tile's offsets in s_l, s_r
    at::Tensor failures;                      // int64, per tile
    std::vector<size_t> tiles;                // indices into tiles_
  };
  // A tile's new inverse root on one side, undefined where it failed: packed, or
  // (quantised bases) its Q and s.
  struct NewRoot {
    at::Tensor packed, q, s;
    bool defined() const { return packed.defined() || q.defined(); }
  };
  void check_options(const ShampooOptions& o) const override;
  void run_step(StepGate& gate, const std::vector<size_t>& stepping) override;
  // Parameter i's state as at construction (its tiles set): zero moments and
  // factors, identity roots.
  void clear_state(size_t i) override;
  // Tile k of parameter i's factors L, R after this step's gradient, written to
  // l_out, r_out (packed, the factor dtype): the state's own views (in place), or
  // new tensors (the state is then left as it is).
  void update_factors(size_t i, size_t k, const at::Tensor& l_out, const at::Tensor& r_out) const;
  // The roots of the due parameters' tiles from the factors this step would
  // store (new_left, new_right: packed, by tile), into new_roots (packed, by tile;
  // a side undefined where its root failed). Changes no state; throws where a tile has
  // now failed three times in a row (the gate then stops every rank).
  void compute_roots(const std::vector<size_t>& due, const std::vector<at::Tensor>& new_left,
                     const std::vector<at::Tensor>& new_right,
                     std::vector<std::pair<NewRoot, NewRoot>>* new_roots);
  // Stores r as tile j's (of parameter i's tiles) root on one side.
  void store_root(size_t i, size_t j, bool left, const NewRoot& r);
  // The gradient of tile k of parameter i (a view: the shard's, or a shared row's).
  at::Tensor grad_tile(size_t i, const Tile& t) const;

  ShampooConfig config_;
  std::vector<bool> precondition_;
  std::vector<ParamState> state_;
  std::vector<Tile> tiles_;
  // Cut rows of tiles, their exchange (one unit per row, in order) and, at
  // their owner, this step's gradient of the row (flat, rows x cols).
  std::vector<CutTileRow> cut_;
  OwnerExchange exchange_;
  std::vector<at::Tensor> cut_g_;
  double root_seconds_ = 0.0;
  int64_t fp64_retries_ = 0;
};

}  // namespace rfsdp
