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
#include "optimizers/common/eigen.h"
#include "optimizers/common/tiled_optimizer.h"
#include "quant/ops.h"

namespace rfsdp {

// Hyperparameters a parameter group may set.
struct ShampooOptions {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, epsilon = 1e-12;
  double grafting_beta2 = 0.999, grafting_epsilon = 1e-8, weight_decay = 0.0;
};

// Settings that shape the state: one per optimizer. factor_dtype stores L, R
// and the packed roots.
struct ShampooConfig : TiledConfig {
  ShampooConfig() : TiledConfig(/*default_frequency=*/20) {}
  int start_preconditioning_step = 20;
  bool use_bias_correction = true;
  RankDeficient rank_deficient = RankDeficient::Shift;
  // PseudoInverse's threshold relative to l_max; < 0: n * eps(float32) for an n x n
  // factor (torch.linalg.matrix_rank's default tolerance).
  double rank_rtol = -1.0;
  // basis coded: each root A^-1/4 = Q diag(s) Q^T kept as Q's codes ("linear_square"
  // is the 4-bit Shampoo paper's map) and s in fp32 (the rule's l^-1/4, 0 where it
  // drops l). Every step that preconditions rebuilds the root from Q dequantised
  // and rectified. Not coded: packed roots in factor_dtype.
};

// Throws std::invalid_argument, naming the setting as Python names it, unless c
// is usable.
void check_config(const ShampooConfig& c);

class Shampoo : public GroupedOptimizer<ShampooOptions, TiledOptimizer> {
 public:
  // precondition[i] false: parameter i takes Adam's direction alone (1-D
  // parameters always do). comm: the ranks that agree on NaN/Inf gradients.
  // options: every group's until set_group_options.
  Shampoo(std::vector<ParamShard> params, ShampooOptions options = {}, ShampooConfig config = {},
          std::shared_ptr<Comm> comm = nullptr, std::vector<bool> precondition = {});

  const char* name() const override { return "Shampoo"; }
  const ShampooConfig& config() const { return config_; }
  // state(i) by name: exp_avg (M), exp_avg_sq (V), and for a preconditioned
  // parameter factor_left, factor_right, root_left, root_right (its tiles'
  // matrices, packed upper triangles in tile order), or with quantised bases
  // root_left_basis_codes, root_left_basis_absmax, root_left_eigenvalues (s, n
  // per tile) and their root_right_ twins; and root_failures (failures in a
  // row, per tile). requantized_state: each root of this rank's tiles as the
  // saved optimizer used it (Q decoded and rectified, with its s; or the packed
  // root, whose eigh gives Q and s), then stored as this one keeps it; every
  // other state this rank's part.

  // Tile j (of parameter i's tiles) of its inverse root on one side, full fp32,
  // as a step uses it (rebuilt from its codes and s where quantised).
  at::Tensor root(size_t i, size_t j, bool left) const;
  // Measurements for benches: seconds spent computing roots, bytes of factors
  // and roots (codes, scales and s where quantised), root flops (about 9 b^3 per
  // b x b eigendecomposition and root) per step that computes them.
  double root_seconds() const { return root_seconds_; }
  int64_t factor_bytes() const;
  double root_flops() const;

 private:
  struct ParamState {
    at::Tensor m, v;                          // fp32, the shard's shape
    at::Tensor root_l, root_r;                // packed roots (factor_dtype)
    quant::LowbitSquares q_l, q_r;            // or (basis coded) the roots' Q codes, by tile,
    at::Tensor s_l, s_r;                      // and their s (fp32, n per tile)
    std::vector<int64_t> sl, sr;              // each tile's offsets in s_l, s_r
    at::Tensor failures;                      // int64, per tile
  };
  // A tile's new inverse root on one side, undefined where it failed: packed, or
  // (quantised bases) its Q and s.
  struct NewRoot {
    at::Tensor packed, q, s;
    bool defined() const { return packed.defined() || q.defined(); }
  };
  const TiledConfig& tiled_config() const override { return config_; }
  void check_options(const ShampooOptions& o) const override;
  // Zero moments, identity roots.
  void clear_moments_and_preconditioner(size_t i) override;
  std::vector<std::pair<std::string, at::Tensor>> moments_state(size_t i) const override;
  std::vector<std::pair<std::string, at::Tensor>> preconditioner_state(size_t i) const override;
  void own_layout(size_t i, const TileRange& r, std::vector<StateLayout>* out) const override;
  NamedState requantized_own(size_t i, const TiledConfig& saved, const NamedState& full,
                             const TileRange& r) const override;

  // The step: the roots are due at t % precondition_frequency == 0; prepare
  // computes the due tiles' factors and their roots before the gate; begin
  // updates the moments, the factors and the roots, and the direction D (P on
  // whole tiles); a cut row's tiles are preconditioned at its owner (M^ and D
  // travel, D comes back); finish applies the update.
  bool amortises(size_t i) const override;
  void prepare(const std::vector<size_t>& stepping) override;
  void begin(size_t i) override;
  void finish(size_t i) override;
  bool tiles_step(size_t i) const override;
  CutRowFields cut_row_fields() const override;
  at::Tensor cut_row_result(const at::Tensor& gathered) const override;
  void cut_tile_step(size_t i, size_t j, const at::Tensor& gathered, const at::Tensor& result) override;
  // P = L^-1/4 M^ R^-1/4 scaled to |D| in tile j of parameter i (d: D's tile, in place).
  void precondition_tile(size_t i, size_t j, at::Tensor d, const at::Tensor& m_hat) const;
  // Tile k of parameter i's factors L, R after this step's gradient, written to
  // l_out, r_out (packed, the factor dtype): the state's own views (in place), or
  // new tensors (the state is then left as it is).
  void update_factors(size_t i, size_t k, const at::Tensor& l_out, const at::Tensor& r_out) const;
  // The roots of the due parameters' tiles from the factors this step would
  // store (new_left_, new_right_: packed, by tile), into new_roots_ (packed, by
  // tile; a side undefined where its root failed). Changes no state; throws where
  // a tile has now failed three times in a row (the gate then stops every rank).
  void compute_roots(const std::vector<size_t>& due);
  // Stores r as tile j's (of parameter i's tiles) root on one side.
  void store_root(size_t i, size_t j, bool left, const NewRoot& r);

  ShampooConfig config_;
  std::vector<ParamState> state_;
  // This step's: by tile, the due tiles' new factors and roots (prepare); by
  // parameter, M^ and the update D (begin).
  std::vector<at::Tensor> new_left_, new_right_;
  std::vector<std::pair<NewRoot, NewRoot>> new_roots_;
  std::vector<at::Tensor> m_hat_, update_;
  double root_seconds_ = 0.0;
};

}  // namespace rfsdp
