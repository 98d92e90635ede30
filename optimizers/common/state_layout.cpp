#include "optimizers/common/state_layout.h"

namespace rfsdp {

TileRange tile_range(const TensorShard& shard, int64_t max_dim) {
  TileRange r;
  r.all = matrix_tiles("tiles", TensorShard::whole(shard.name, shard.shape, shard.row_dims), 0,
                       max_dim);
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
