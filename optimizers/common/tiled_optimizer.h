// What the tiled optimizers (Shampoo, SOAP) share, as DistributedShampoo's one
// preconditioner-list base whose amortised computation is the only difference:
// every matrix of a parameter cut into tiles of at most B x B (tiles.h), each
// tile's Kronecker factors L, R (packed upper triangles, factor_dtype), the rows
// of tiles that shard boundaries cut and their owner exchange (cut_rows.h), the
// step's skeleton, and the shared part of the state, its layout and its
// requantisation. A derived optimizer keeps its amortised computation (inverse
// roots, eigenbases: prepare), its moments and its per-tile direction.
//
// A step: the cut rows' gradients to their owners; prepare() before the gate
// (what the step would store, computed before anything changes); the gate;
// begin() per parameter (moments, the direction of its whole tiles), finish()
// at once where it has no cut rows; the cut rows' step at their owners and
// back; finish() for the parameters with cut rows.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <utility>
#include <vector>

#include "optimizers/common/cut_rows.h"
#include "optimizers/common/owner_exchange.h"
#include "optimizers/common/requantize.h"
#include "optimizers/common/sharded_optimizer.h"
#include "optimizers/common/state_layout.h"
#include "optimizers/common/tiled_config.h"
#include "optimizers/common/tiles.h"

namespace rfsdp {

class TiledOptimizer : public ShardedOptimizer {
 public:
  using ShardedOptimizer::ShardedOptimizer;

  const std::vector<Tile>& tiles() const { return tiles_; }
  // Rows of tiles that shard boundaries cut (over all ranks).
  const std::vector<CutTileRow>& cut_rows() const { return cut_; }
  bool preconditioned(size_t i) const { return precondition_.at(i); }
  // Eigendecompositions retried in fp64 (eigen.h) so far.
  int64_t fp64_retries() const { return fp64_retries_; }

  // Parameter i's moments, then (preconditioned) factor_left, factor_right (its
  // tiles' L, R: packed upper triangles in tile order), then its preconditioner's.
  std::vector<std::pair<std::string, at::Tensor>> state(size_t i) const final;
  std::vector<StateLayout> state_layout(size_t i) const final;
  // Parameter i's state as this optimizer keeps it, from a checkpoint's whole
  // state of it saved by the same optimizer with the storage of `saved`: the
  // factors this rank's part as saved, the rest as requantized_own says.
  NamedState requantized_state(size_t i, const TiledConfig& saved, const NamedState& full) const;

 protected:
  virtual const TiledConfig& tiled_config() const = 0;
  // The constructor's end (after the checks of the config and the options):
  // which parameters are preconditioned (precondition[i]; empty: all; 1-D ones
  // never), their tiles, the cut rows' exchange, and each parameter's state.
  void set_up_tiles(const std::vector<bool>& precondition);

  // Parameter i's state as at construction: zero factors, and the derived
  // optimizer's part (clear_moments_and_preconditioner).
  void clear_state(size_t i) final;
  virtual void clear_moments_and_preconditioner(size_t i) = 0;

  // The state but the factors: the moments and the preconditioner (state()
  // puts the factors between them), their layouts (r: the tensor's tiles, empty
  // where it is not preconditioned), and requantized_state's part for a
  // preconditioned parameter (saved: the settings it was saved with, of the
  // derived optimizer's config type).
  virtual std::vector<std::pair<std::string, at::Tensor>> moments_state(size_t i) const = 0;
  virtual std::vector<std::pair<std::string, at::Tensor>> preconditioner_state(size_t i) const = 0;
  virtual void own_layout(size_t i, const TileRange& r, std::vector<StateLayout>* out) const = 0;
  virtual NamedState requantized_own(size_t i, const TiledConfig& saved, const NamedState& full,
                                     const TileRange& r) const = 0;

  // The step's parts (see the top). amortises(i): parameter i's amortised
  // computation is due this step (its gradient is then checked before prepare).
  virtual bool amortises(size_t i) const = 0;
  virtual void prepare(const std::vector<size_t>& stepping) = 0;
  virtual void begin(size_t i) = 0;
  virtual void finish(size_t i) = 0;
  // Whether parameter i's tiles take their direction this step.
  virtual bool tiles_step(size_t i) const = 0;
  // The cut rows' step: their fields to the owners, the owners' tiles of them
  // (cut_tile_step for each owned tile of a parameter whose tiles step) and the
  // results back to every holder. Overridden where the rows travel otherwise.
  virtual void step_cut_rows(const std::vector<size_t>& stepping);
  // What step_cut_rows moves: per field, per parameter, the flat tensors whose
  // cut rows go to their owner (to_owner) and those the owners' results land
  // in (back: [F, numel] results, or [numel] for F = 1).
  struct CutRowFields {
    std::vector<std::vector<at::Tensor>> to_owner, back;
  };
  virtual CutRowFields cut_row_fields() const = 0;
  // At the owner: the result of a row from what came ([F to_owner, numel]).
  virtual at::Tensor cut_row_result(const at::Tensor& gathered) const = 0;
  // Tile j of parameter i (its row gathered, its result) takes its direction.
  virtual void cut_tile_step(size_t i, size_t j, const at::Tensor& gathered,
                             const at::Tensor& result) = 0;

  // Parameter i's tile indices (into tiles_), in tile order.
  const std::vector<size_t>& tiles_of(size_t i) const { return param_tiles_[i]; }
  bool has_cut_rows(size_t i) const;
  // Parameter i's packed factors on one side (flat, its tiles in order), and
  // tile k's of them (a view).
  const at::Tensor& factors(size_t i, bool left) const;
  at::Tensor factor(size_t i, size_t k, bool left) const;
  // The gradient of tile t of parameter i (a view: the shard's, or its cut row's).
  at::Tensor grad_tile(size_t i, const Tile& t) const;

  std::vector<bool> precondition_;
  std::vector<Tile> tiles_;
  // Cut rows of tiles, their exchange (one unit per row, in order) and, at
  // their owner, this step's gradient of the row (flat, rows x cols).
  std::vector<CutTileRow> cut_;
  OwnerExchange exchange_;
  std::vector<at::Tensor> cut_g_;
  int64_t fp64_retries_ = 0;

 private:
  void run_step(StepGate& gate, const std::vector<size_t>& stepping) final;

  std::vector<std::vector<size_t>> param_tiles_;
  struct Factors {
    at::Tensor left, right;  // flat packed storage, the parameter's tiles in order
  };
  std::vector<Factors> factors_;
};

}  // namespace rfsdp
