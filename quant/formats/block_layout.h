// Where the quantisation blocks of one tensor (or of one rank's whole-block
// shard of it) lie. Plain C++: shared by the CPU and CUDA kernels.
//
// A tensor is seen as rows x row_len (docs/design.md). Blocks are either 1-D
// blocks of B consecutive elements of the flattened tensor, or 2-D tiles of
// tile_rows x tile_cols over rows x row_len. The last block, or the last tile
// of a row or column of tiles, may be partial. Blocks are numbered 1-D in
// order, tiles row-major over the tile grid.
#pragma once

#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <string>

#if defined(__CUDACC__)
#define RFSDP_HOST_DEVICE __host__ __device__
#else
#define RFSDP_HOST_DEVICE
#endif

namespace rfsdp::quant {

struct BlockShape {
  int64_t block = 256;     // 1-D block size (used when tile_rows == 0)
  int64_t tile_rows = 0;   // 2-D tile, rows
  int64_t tile_cols = 0;   // 2-D tile, columns

  static BlockShape blocks(int64_t b) { return {b, 0, 0}; }
  static BlockShape tiles(int64_t r, int64_t c) { return {0, r, c}; }
  RFSDP_HOST_DEVICE bool is_tile() const { return tile_rows > 0; }

  void check() const {
    if (is_tile() ? (tile_rows < 1 || tile_cols < 1) : block < 1) {
      throw std::invalid_argument("quantisation block sizes must be positive, got " + str());
    }
  }
  std::string str() const {
    return is_tile() ? std::to_string(tile_rows) + "x" + std::to_string(tile_cols) + " tiles"
                     : "1-D blocks of " + std::to_string(block);
  }
  // The planner granule (rows) that starts every shard on a block edge.
  int64_t granule_rows(int64_t row_len) const {
    return is_tile() ? tile_rows : block / std::gcd(block, row_len);
  }
};

// Throws std::invalid_argument, naming the tensor, when rows [row_begin,
// row_begin + rows) of a full_rows x row_len tensor cut one of its blocks: a
// shard must start on a block edge and end on one or at the tensor's end.
inline void check_whole_blocks(const BlockShape& s, const std::string& name, int64_t full_rows,
                               int64_t row_len, int64_t row_begin, int64_t rows) {
  if (rows == 0) return;
  const int64_t end = row_begin + rows;
  auto on_edge = [&](int64_t row) {
    return s.is_tile() ? row % s.tile_rows == 0 : (row * row_len) % s.block == 0;
  };
  if (!on_edge(row_begin) || !(end == full_rows || on_edge(end))) {
    throw std::invalid_argument(
        "parameter '" + name + "': this shard holds rows [" + std::to_string(row_begin) + ", " +
        std::to_string(end) + ") of " + std::to_string(full_rows) + ", which cut its " + s.str() +
        "; plan the unit with the 8-bit granule (" + std::to_string(s.granule_rows(row_len)) +
        " rows; rfsdp.policy.blockwise_8bit in Python) so every shard holds whole blocks");
  }
}

// The blocks of a (rows x row_len) region, each as `segments` runs of
// `seg_len` contiguous elements, `row_len` apart.
struct BlockLayout {
  BlockShape shape;
  int64_t rows = 0, row_len = 1, numel = 0;
  int64_t tiles_per_row = 1;  // tiles only
  int64_t num_blocks = 0;

  BlockLayout() = default;
  BlockLayout(BlockShape s, int64_t rows_, int64_t row_len_)
      : shape(s), rows(rows_), row_len(row_len_), numel(rows_ * row_len_) {
    s.check();
    if (shape.is_tile()) {
      tiles_per_row = (row_len + shape.tile_cols - 1) / shape.tile_cols;
      num_blocks = ((rows + shape.tile_rows - 1) / shape.tile_rows) * tiles_per_row;
    } else {
      num_blocks = (numel + shape.block - 1) / shape.block;
    }
  }

  struct Block {
    int64_t start, segments, seg_len, count;  // count = segments * seg_len
  };
  RFSDP_HOST_DEVICE Block block(int64_t b) const {
    if (!shape.is_tile()) {
      const int64_t start = b * shape.block;
      const int64_t len = numel - start < shape.block ? numel - start : shape.block;
      return {start, 1, len, len};
    }
    const int64_t tr = b / tiles_per_row, tc = b % tiles_per_row;
    const int64_t r0 = tr * shape.tile_rows, c0 = tc * shape.tile_cols;
    const int64_t nr = rows - r0 < shape.tile_rows ? rows - r0 : shape.tile_rows;
    const int64_t nc = row_len - c0 < shape.tile_cols ? row_len - c0 : shape.tile_cols;
    return {r0 * row_len + c0, nr, nc, nr * nc};
  }
  RFSDP_HOST_DEVICE int64_t max_block_elems() const {
    return shape.is_tile() ? shape.tile_rows * shape.tile_cols : shape.block;
  }
};

}  // namespace rfsdp::quant
