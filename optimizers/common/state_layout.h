// Where each state tensor of a parameter lies in the global tensor a checkpoint
// keeps (the same on every rank and at every world size), so that a checkpoint
// places and reshards optimizer state without knowing any optimizer: every
// optimizer describes its own (ShardedOptimizer::state_layout).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/ragged/tensor_shard.h"
#include "optimizers/common/tiles.h"
#include "quant/ops.h"

namespace rfsdp {

struct StateLayout {
  enum class Kind {
    kRows,      // this rank's rows of a tensor of the parameter's global shape (its
                // shard's shape: moments, momentum, codes by element)
    kSequence,  // elements [offset, offset + numel) of a 1-D global sequence of
                // `total` (block scales, per-tile factors, roots, bases)
  };
  std::string name;  // as state() names it
  Kind kind = Kind::kRows;
  int64_t total = 0, offset = 0;
  // kSequence: leading elements an earlier rank also holds (an 8-bit block that a
  // shard boundary cuts: its scale is that rank's to write).
  int64_t shared = 0;
  // kSequence: where not empty, the piece lies in these runs (offset, numel) of the
  // sequence, one after another, not from `offset` on (a parameter held in column
  // parts: its row segments and their blocks are a run each in the global order).
  std::vector<std::pair<int64_t, int64_t>> runs;

  static StateLayout rows(std::string name) { return {std::move(name), Kind::kRows, 0, 0, 0, {}}; }
  static StateLayout sequence(std::string name, int64_t total, int64_t offset, int64_t shared = 0) {
    return {std::move(name), Kind::kSequence, total, offset, shared, {}};
  }
  // Runs (offset, numel) of a sequence of `total`, merged where one continues the
  // last; `shared` as sequence's (leading elements of the first run).
  static StateLayout sequence_runs(std::string name, int64_t total,
                                   const std::vector<std::pair<int64_t, int64_t>>& runs,
                                   int64_t shared = 0);
};


// The tiles of the whole tensor `shard` describes, in tile order, and those this
// rank keeps state for, [first, end): the tiles whose first element lies in its
// rows (whole tiles, and the tiles of the cut rows it owns).
struct TileRange {
  std::vector<Tile> all;  // local_offset: the tile's first element in the whole tensor
  size_t first = 0, end = 0;
  // Held in column parts (TensorShard::col_parts; `all` in the shard's order, the
  // parts' tiles one after another): each tile's index in the global matrix's tile
  // order, which the sequences keep. Empty: the same order.
  std::vector<size_t> global;
};
TileRange tile_range(const TensorShard& shard, int64_t max_dim);

// A per-tile state of elements(tile) each, in tile order, as this rank's piece of
// the tensor's global sequence.
template <class Elements>
StateLayout tile_sequence(std::string name, const TileRange& r, Elements elements) {
  if (!r.global.empty()) {  // runs of the global order
    std::vector<int64_t> start(r.all.size() + 1, 0);  // by global index: where its state starts
    for (size_t k = 0; k < r.all.size(); ++k) start[r.global[k] + 1] = elements(r.all[k]);
    for (size_t g = 0; g < r.all.size(); ++g) start[g + 1] += start[g];
    std::vector<std::pair<int64_t, int64_t>> runs;
    for (size_t k = r.first; k < r.end; ++k) runs.emplace_back(start[r.global[k]], elements(r.all[k]));
    return StateLayout::sequence_runs(std::move(name), start.back(), runs);
  }
  int64_t total = 0, offset = 0;
  for (size_t k = 0; k < r.all.size(); ++k) {
    if (k == r.first) offset = total;
    total += elements(r.all[k]);
  }
  if (r.first == r.all.size()) offset = total;
  return StateLayout::sequence(std::move(name), total, offset);
}

// A per-tile sequence of square matrices on one side (left: rows x rows) as
// `format` stores them: coded, name + "_codes" and name + "_absmax"
// (LowbitSquares' runs); else name, n * n entries per tile. Appended to *out.
void square_tiles_layout(const std::string& name, const TileRange& r, bool left,
                         const quant::LowBitFormat& format, std::vector<StateLayout>* out);

}  // namespace rfsdp
