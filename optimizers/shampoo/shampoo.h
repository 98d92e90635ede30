// Block Shampoo with Adam grafting (DistributedShampoo's algorithm) over ragged
// shards. Every matrix of a parameter (see optimizers/common/matrices.h) is cut
// into tiles of at most B x B (B = max_preconditioner_dim); the planner's
// Shampoo granule keeps every tile whole on one rank, so each rank keeps and
// inverts the factors of its own tiles: the sharded step is the single-device
// step, and nothing but the NaN/Inf flag is communicated. Where shard
// boundaries cut a row of tiles (torch FSDP2's chunk rows, a plan without the
// granule), the rank holding the row's first element owns it (SharedTileRow):
// the other holders send it their gradient rows before the gate and their
// M^ and D rows after it, and get their rows of the update back (three
// all-to-alls a step for all such rows).
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

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/comm/comm.h"
#include "optimizers/common/sharded_optimizer.h"
#include "quant/blockwise/lowbit.h"

namespace rfsdp {

// Hyperparameters a parameter group may set.
struct ShampooOptions {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, epsilon = 1e-12;
  double grafting_beta2 = 0.999, grafting_epsilon = 1e-8, weight_decay = 0.0;
};

// What the inverse root does with the eigenvalues l of A = L / bc + eps I, which
// are >= eps in exact arithmetic but, for a rank-deficient factor (a tile whose
// gradients span fewer than its rows: rare tokens, zero rows, low-rank
// updates), fall below eps, or below zero, by rounding (about -1e-8 l_max in
// fp32, -2^-9 l_max in bf16).
enum class RankDeficient {
  // l <- l - l_min + eps where l_min < eps: the spectrum lifted so that its
  // smallest eigenvalue is eps (DistributedShampoo's perturbation). Needs eps > 0.
  Shift,
  // l <= rank_rtol * l_max count as zero: their directions get no
  // preconditioning (a zero root there; a tile whose root is all zero takes D).
  PseudoInverse,
  // Any l <= 0 is a failure (retried in fp64): the three-failures error.
  Strict,
};
RankDeficient parse_rank_deficient(const std::string& s);  // "shift" | "pseudo_inverse" | "strict"
const char* to_string(RankDeficient r);

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
  // basis_bits 8 or 4: each root A^-1/4 = Q diag(s) Q^T kept as Q's block-wise
  // codes (blocks of basis_block elements of the n x n eigenvector matrix, row by
  // row, one fp32 absmax each; map basis_map: lowbit_map's "linear_square" (the
  // 4-bit Shampoo paper's), "linear", or "dynamic" at 8 bits) and s in fp32 (the
  // rule's l^-1/4, 0 where it drops l). Every step that preconditions rebuilds
  // the root from Q dequantised and rectified by bjorck_iterations Björck steps.
  // 0: packed roots in factor_dtype.
  int basis_bits = 0;
  int64_t basis_block = 64;
  std::string basis_map = "linear_square";
  int bjorck_iterations = 1;
};

// One tile of a parameter on this rank: rows [row0, row0 + rows) and columns
// [col0, col0 + cols) of matrix `matrix`; its first element is local_offset in
// the shard, rows are `stride` elements apart; its factors start at
// left_offset / right_offset in the parameter's flat factor storage, where each
// symmetric n x n matrix (L, R, a root) is its upper triangle, row by row:
// n (n + 1) / 2 elements (shampoo_packed_size).
struct ShampooTile {
  size_t param;
  int64_t matrix, row0, rows, col0, cols;
  int64_t local_offset, stride;
  int64_t left_offset, right_offset;
  // >= 0: a tile of shared row `shared` (this rank owns it); local_offset is then
  // in that row's gathered buffers, not in the shard.
  int64_t shared = -1;
};

// A row of tiles (rows [row0, row0 + rows) of matrix `matrix`, all `cols`
// columns: elements [begin, end) of the flattened tensor) that shard boundaries
// cut. parts[r]: the elements rank r holds ([begin, end) of them; empty: none);
// the owner is the rank holding `begin`, so each rank's tiles stay in the
// tensor's tile order (a checkpoint's sequence does not depend on the ranks).
struct SharedTileRow {
  size_t param;
  int64_t matrix, row0, rows, cols;
  int64_t begin, end;
  int owner;
  std::vector<std::pair<int64_t, int64_t>> parts;
};

inline int64_t shampoo_packed_size(int64_t n) { return n * (n + 1) / 2; }

// Tile t of a flat tensor laid out as its shard (or a shared row's buffer):
// rows x cols, rows `stride` apart (a view). Shampoo's and SOAP's.
inline at::Tensor shampoo_tile_view(const at::Tensor& flat, const ShampooTile& t) {
  return flat.as_strided({t.rows, t.cols}, {t.stride, 1}, flat.storage_offset() + t.local_offset);
}

// The preconditioner tiles that `shard` holds whole, and (shared given, every
// rank's rows known) those of the rows of tiles it owns; every cut row of tiles
// of the tensor is appended to *shared (rank: this rank's index among the
// shard's ranks). Throws, naming the optimizer `who`, the parameter and the
// tile, and what keeps tiles whole (an rfsdp plan, or for FSDP2's chunk rows a
// max_preconditioner_dim that divides them), when the shard cuts a tile and
// shared is null or the other ranks' rows are unknown.
std::vector<ShampooTile> shampoo_tiles(const char* who, const ParamShard& shard, size_t param,
                                       int64_t max_dim, int rank = -1,
                                       std::vector<SharedTileRow>* shared = nullptr);

// The granule (rows of `shape` seen with row_dims) that keeps every tile on one rank.
int64_t shampoo_granule_rows(const std::vector<int64_t>& shape, int row_dims, int64_t max_dim);

// How inverse_fourth_roots treats the eigenvalues (see RankDeficient):
// floors[k] is matrix k's eps (Shift), rtol PseudoInverse's threshold (< 0: n *
// eps(float32)).
struct RootRule {
  RankDeficient mode = RankDeficient::Strict;
  std::vector<double> floors;  // one per matrix (Shift)
  double rtol = -1.0;
};

// A^(-1/4) of symmetric matrices of one size (batched eigh in fp32, each
// failure retried alone in fp64), their eigenvalues treated by `rule`. ok[k] is
// false where both failed (no convergence, a non-finite eigenvalue or root, or
// under Strict a non-positive eigenvalue); out[k] is then undefined. Counts
// the fp64 retries in *retries. eigen given: (*eigen)[k] = (Q, s), fp32, with
// out[k] = Q diag(s) Q^T (Q's columns by ascending eigenvalue of A).
std::vector<at::Tensor> inverse_fourth_roots(const std::vector<at::Tensor>& a,
                                             std::vector<bool>* ok, int64_t* retries = nullptr,
                                             const RootRule& rule = {},
                                             std::vector<std::pair<at::Tensor, at::Tensor>>* eigen = nullptr);

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

  const std::vector<ShampooTile>& tiles() const { return tiles_; }
  // Rows of tiles that shard boundaries cut (over all ranks).
  const std::vector<SharedTileRow>& shared_rows() const { return shared_; }
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

  // Symmetric matrices packed as upper triangles (Shampoo's and SOAP's factors):
  // the n x n matrix at `offset` of `flat` as a full fp32 matrix, and a full
  // matrix packed (float32).
  static at::Tensor unpack(const at::Tensor& flat, int64_t offset, int64_t n);
  static at::Tensor pack(const at::Tensor& full);

 private:
  struct ParamState {
    at::Tensor m, v;                          // fp32, the shard's shape
    at::Tensor left, right, root_l, root_r;   // flat factor storage (factor_dtype)
    quant::LowbitSquares q_l, q_r;            // or (basis_bits) the roots' Q codes, by tile,
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
  // A shared row's part on one side of an exchange: the row, the other rank, the
  // part's first element in this rank's shard (contributor) or in the row (owner).
  struct PartRef {
    size_t row;
    int peer;
    int64_t local, at, n;
  };
  // One all-to-all over the shared rows' parts: forward, each holder's parts to
  // the owners (head + width floats per element each, written by fill, read by
  // take); back, the owners' to the holders.
  void exchange(bool forward, int64_t head, int64_t width,
                const std::function<void(const PartRef&, float*)>& fill,
                const std::function<void(const PartRef&, const float*)>& take);
  // The gradient of tile k of parameter i (a view: the shard's, or a shared row's).
  at::Tensor grad_tile(size_t i, const ShampooTile& t) const;

  ShampooConfig config_;
  std::vector<bool> precondition_;
  std::vector<ParamState> state_;
  std::vector<ShampooTile> tiles_;
  // Shared rows of tiles; at their owner, gathered gradient, M^ and D (rows x cols).
  std::vector<SharedTileRow> shared_;
  std::vector<at::Tensor> shared_g_, shared_m_, shared_d_;
  std::vector<PartRef> held_parts_;   // parts this rank holds, by owner then row
  std::vector<PartRef> owned_parts_;  // parts of the rows this rank owns, by holder then row
  double root_seconds_ = 0.0;
  int64_t fp64_retries_ = 0;
};

}  // namespace rfsdp
