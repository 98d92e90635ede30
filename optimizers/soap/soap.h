// SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam"):
// Adam in the eigenbasis of Shampoo's factors, over ragged shards. The tiles are
// Shampoo's (optimizers/common/tiles.h: every matrix cut into tiles of at most
// B x B, B = max_preconditioner_dim; rfsdp.policy.shampoo(B) keeps each whole on
// one rank), so each tile's factors, bases and moments live on the rank that
// holds it: the sharded step is the single-device step, and nothing but the step
// gate's flag is communicated. Where shard boundaries cut a row of tiles (torch
// FSDP2's chunk rows), its owner (the rank holding its first element) gets the
// other holders' gradient rows before the gate and their m and v rows after it,
// steps its tiles, and sends them their rows of v and of the direction back
// (optimizers/common/owner_exchange.h: three all-to-alls a step for all such rows).
//
// Per parameter with gradient g, t its count of steps with a gradient, per tile G:
//   t = 1: L = (1 - b_s) G G^T, R = (1 - b_s) G^T G; Q_L, Q_R their eigenvectors by
//     descending eigenvalue (eigh in fp32, retried in fp64). No update (1-D
//     parameters skip their first step too).
//   t >= 2, s = t - 1: G' = Q_L^T G Q_R; m <- b1 m + (1 - b1) G; v <- b2 v + (1 - b2) G'^2;
//     N = Q_L ((Q_L^T m Q_R) / (sqrt(v) + eps)) Q_R^T (1-D: v <- b2 v + (1 - b2) g^2,
//     N = m / (sqrt(v) + eps)); p <- (p - step N) (1 - lr wd), step = lr sqrt(1 - b2^s) /
//     (1 - b1^s) (lr without correct_bias); then L <- b_s L + (1 - b_s) G G^T, R likewise;
//     when s % precondition_frequency == 0, per side: order = argsort(diag(Q^T X Q),
//     descending), Q <- qr(X Q[:, order]).Q, and v permuted by order along that side
//     (rows for L, columns for R).
// m is kept in the original basis, v in the eigenbasis; both have the shard's shape.
// b_s = shampoo_beta (negative: b2). A step changes nothing until every rank has
// agreed that it can be taken (StepGate): first bases and refreshed ones are
// computed from the factors the step would store, before anything changes.
// eigh and QR run batched, one call per tile size. States live with the shard
// (CPU or GPU).
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
struct SOAPOptions {
  double lr = 3e-3, beta1 = 0.95, beta2 = 0.95;
  double shampoo_beta = -1.0;  // < 0: beta2
  double eps = 1e-8, weight_decay = 0.01;
};

// Settings that shape the state: one per optimizer. factor_dtype stores L, R;
// every step computes in fp32 from them, and a refresh and a first basis use the
// fp32 factors of this step before they are stored.
struct SOAPConfig : TiledConfig {
  SOAPConfig() : TiledConfig(/*default_frequency=*/10) {}
  bool correct_bias = true;
  // Storage of Q_L, Q_R where basis is not coded: float32 or bfloat16.
  at::ScalarType basis_dtype = at::kFloat;
  // m and v of preconditioned parameters: float32, or at::kByte: 8-bit codes
  // (bitsandbytes' dynamic maps, signed for m, unsigned for v), one block per
  // tile row (a block never crosses a tile, and v's refresh permutation, rows
  // and columns, moves whole blocks or stays inside one: codes move with their
  // scales, nothing is requantised by it). Each step decodes a parameter's
  // moments, updates them in fp32 and encodes them once it is done (on any
  // device: quant/ops/state_ops.h). A tile row that shard boundaries cut
  // (FSDP2's chunk rows) is coded by its owner, which keeps its scales (tile
  // order) while each holder keeps its rows' codes; 1-D parameters and
  // use_soap=False groups keep fp32 moments.
  at::ScalarType state_dtype = at::kFloat;
  // The 8-bit moments' codes: the dynamic maps, or float8_e4m3fn codes
  // (formats/fp8_e4m3.h: the same blocks and absmax, decoded by arithmetic).
  quant::StateFormat state_format = quant::StateFormat::kDynamic;
  // basis coded: Q_L, Q_R as block-wise codes (the refresh's power step uses
  // them decoded and rectified too).
  static std::vector<std::string> requantizable() {
    auto names = TiledConfig::requantizable();
    names.push_back("state_dtype");
    names.push_back("state_format");
    return names;
  }
};

// Throws std::invalid_argument, naming the setting as Python names it, unless c
// is usable.
void check_config(const SOAPConfig& c);

class SOAP : public GroupedOptimizer<SOAPOptions, TiledOptimizer> {
 public:
  // precondition[i] false: parameter i takes Adam (with SOAP's first-step skip
  // and weight decay); 1-D parameters always do. comm: the ranks that step together.
  SOAP(std::vector<ParamShard> params, SOAPOptions options = {}, SOAPConfig config = {},
       std::shared_ptr<Comm> comm = nullptr, std::vector<bool> precondition = {});

  const char* name() const override { return "SOAP"; }
  const SOAPConfig& config() const { return config_; }
  // state(i) by name: exp_avg (m), exp_avg_sq (v, in the eigenbasis), or with
  // 8-bit moments exp_avg_codes, exp_avg_absmax, exp_avg_sq_codes,
  // exp_avg_sq_absmax (codes in the shard's shape, one absmax per tile row in
  // tile order); for a preconditioned parameter, factor_left, factor_right and
  // basis_left, basis_right (Q_L, Q_R: n x n row by row, in tile order).
  // requantized_state: each basis of this rank's tiles as the saved optimizer
  // used it (decoded and rectified where coded) and m and v decoded, then
  // stored as this one keeps them; the factors this rank's part as saved.

  // Tile j (of parameter i's tiles) of its basis on one side, as a step uses it:
  // fp32 (a copy when stored in bf16; dequantised and rectified when quantised).
  at::Tensor basis(size_t i, size_t j, bool left) const;
  // Parameter i's m and v in fp32 (decoded where they are stored in 8 bits).
  std::pair<at::Tensor, at::Tensor> moments(size_t i) const;

 private:
  struct ParamState {
    at::Tensor m, v;                 // fp32, the shard's shape (undefined when 8-bit)
    at::Tensor mq, vq, ma, va;       // 8-bit: codes (the shard's shape), absmax per tile row
    std::vector<int64_t> arow;       // 8-bit: each tile's first row in ma, va
    at::Tensor q_left, q_right;      // bases, n x n each, flat (basis_dtype)
    quant::LowbitSquares lq_left, lq_right;  // or (basis coded) their codes, by tile
    std::vector<int64_t> ql, qr;     // each tile's offsets in q_left, q_right
  };
  // What a step computes for a tile before the gate: its new factors (full fp32)
  // and, at t = 1 or a refresh, its new bases (fp32) and (refresh) the orders of v
  // and the bases the step rotates with (basis(), decoded once for both uses).
  struct TileUpdate {
    at::Tensor l, r, q_l, q_r, order_l, order_r, used_l, used_r;
  };
  const TiledConfig& tiled_config() const override { return config_; }
  void check_options(const SOAPOptions& o) const override;
  // Every moment and basis zero (the first step computes the bases).
  void clear_moments_and_preconditioner(size_t i) override;
  std::vector<std::pair<std::string, at::Tensor>> moments_state(size_t i) const override;
  std::vector<std::pair<std::string, at::Tensor>> preconditioner_state(size_t i) const override;
  void own_layout(size_t i, const TileRange& r, std::vector<StateLayout>* out) const override;
  NamedState requantized_own(size_t i, const TiledConfig& saved, const NamedState& full,
                             const TileRange& r) const override;

  // The step: bases are due at t = 1 (first) and t - 1 % precondition_frequency
  // == 0 (refresh); prepare computes every stepping tile's new factors and the
  // due bases before the gate; begin (t >= 2) updates m and v and the direction
  // n of whole tiles (8-bit: decoded first); a cut row's tiles step at its
  // owner (m and v travel, v and n come back; 8-bit: step_cut_rows); finish
  // applies the update and stores the factors, the bases and v's refresh
  // permutation (8-bit: encoded).
  bool amortises(size_t i) const override;
  void prepare(const std::vector<size_t>& stepping) override;
  void begin(size_t i) override;
  void finish(size_t i) override;
  bool tiles_step(size_t i) const override;
  void step_cut_rows(const std::vector<size_t>& stepping) override;
  CutRowFields cut_row_fields() const override;
  at::Tensor cut_row_result(const at::Tensor& gathered) const override;
  void cut_tile_step(size_t i, size_t j, const at::Tensor& gathered, const at::Tensor& result) override;
  // Tile j of parameter i: v updated in its eigenbasis, n = Q_L ((Q_L^T m Q_R) /
  // (sqrt(v) + eps)) Q_R^T. g, m, v, n: flat, laid out as the tile's shard or cut row.
  void tile_step(size_t i, size_t j, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
                 const at::Tensor& n) const;
  // (A refresh) v of tile k permuted to its basis' new order, once the step has used it.
  void permute_v(size_t k, const at::Tensor& v) const;
  double shampoo_beta(const SOAPOptions& o) const { return o.shampoo_beta < 0 ? o.beta2 : o.shampoo_beta; }
  // Stores q (fp32, n x n) as that basis.
  void store_basis(size_t i, size_t j, bool left, const at::Tensor& q);
  bool eight_bit(size_t i) const { return state_dtype_8bit_ && precondition_[i]; }
  // 8-bit moments of parameter i: decoded into a flat fp32 tensor, or encoded
  // from one (its whole tiles; the rows of cut tiles are their owner's to code).
  at::Tensor decode(size_t i, bool second) const;
  void encode(size_t i, bool second, const at::Tensor& flat);
  // Its tile j: codes (flat uint8, laid out as the tile's shard or cut row) to
  // out (fp32, alike), and back (the tile's scales set).
  void decode_tile(size_t i, size_t j, bool second, const at::Tensor& codes, const at::Tensor& out) const;
  void encode_tile(size_t i, size_t j, bool second, const at::Tensor& flat, const at::Tensor& codes);
  // The cut rows' step with 8-bit moments (their codes travel).
  void step_cut_rows_8bit(const std::vector<size_t>& stepping);

  SOAPConfig config_;
  std::vector<ParamState> state_;
  // This step's: by tile, prepare's results; by parameter, m, v and n (begin).
  std::vector<TileUpdate> up_;
  std::vector<at::Tensor> ms_, vs_, ns_;
  bool state_dtype_8bit_ = false;
  quant::Codec code_m_, code_v_;  // 8-bit: signed, unsigned maps
};

}  // namespace rfsdp
