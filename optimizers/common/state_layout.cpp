#include "optimizers/common/state_layout.h"

namespace rfsdp {

StateLayout StateLayout::sequence_runs(std::string name, int64_t total,
                                       const std::vector<std::pair<int64_t, int64_t>>& runs,
                                       int64_t shared) {
  StateLayout l = sequence(std::move(name), total, runs.empty() ? 0 : runs[0].first, shared);
  for (const auto& [o, n] : runs) {
    if (!l.runs.empty() && l.runs.back().first + l.runs.back().second == o) {
      l.runs.back().second += n;
    } else {
      l.runs.emplace_back(o, n);
    }
  }
  if (l.runs.size() <= 1) l.runs.clear();  // (one run: offset says it)
  return l;
}

TileRange tile_range(const TensorShard& shard, int64_t max_dim) {
  TileRange r;
  if (shard.col_parts > 1) {
    const int64_t parts = shard.col_parts, rows = shard.shape[0];
    r.all = matrix_tiles("tiles", TensorShard::column_parts(shard.name, shard.shape, static_cast<int>(parts), 0,
                                                            parts * rows),
                         0, max_dim);
    // Part j's tile (row0, col0) is the global (row0, j * width + col0): global tile
    // rows of (columns / max_dim) tiles, part j's from j * (width / max_dim) on.
    const int64_t per_part = shard.row_len / max_dim, per_row = parts * per_part;
    for (const Tile& t : r.all) {
      r.global.push_back(static_cast<size_t>(t.row0 / max_dim * per_row + t.matrix * per_part +
                                             t.col0 / max_dim));
    }
  } else {
    r.all = matrix_tiles("tiles", TensorShard::whole(shard.name, shard.shape, shard.row_dims), 0,
                         max_dim);
  }
  const int64_t e0 = shard.row_begin * shard.row_len, e1 = shard.row_end * shard.row_len;
  r.first = r.all.size();
  for (size_t k = 0; k < r.all.size(); ++k) {
    const int64_t at = r.all[k].local_offset;
    if (at >= e0 && r.first == r.all.size()) r.first = k;
    if (at < e1) r.end = k + 1;
  }
  if (r.end < r.first) r.end = r.first;
  return r;
}

void square_tiles_layout(const std::string& name, const TileRange& r, bool left,
                         const quant::LowBitFormat& format, std::vector<StateLayout>* out) {
  const auto n = [left](const Tile& t) { return left ? t.rows : t.cols; };
  if (!format.coded()) {
    out->push_back(tile_sequence(name, r, [&](const Tile& t) { return n(t) * n(t); }));
    return;
  }
  out->push_back(tile_sequence(name + "_codes", r, [&](const Tile& t) {
    return quant::lowbit_code_bytes(n(t) * n(t), format.bits);
  }));
  out->push_back(tile_sequence(name + "_absmax", r, [&](const Tile& t) {
    return quant::lowbit_blocks(n(t) * n(t), format.block);
  }));
}

}  // namespace rfsdp
