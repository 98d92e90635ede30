// The preconditioner tiles of the matrix optimizers (Shampoo, SOAP): every
// matrix of a parameter (matrices.h) cut into tiles of at most B x B rows and
// columns (B = max_preconditioner_dim), and the rows of tiles that shard
// boundaries cut. The planner's tile granule (tile_granule_rows) keeps every
// tile whole on one rank; where a layout is not ours (torch FSDP2's chunk rows),
// a cut row of tiles goes to one owner and back (owner_exchange.h).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/ragged/tensor_shard.h"

namespace rfsdp {

// Elements of a symmetric n x n matrix stored as its upper triangle, row by row.
inline int64_t packed_size(int64_t n) { return n * (n + 1) / 2; }

// One tile of a parameter on this rank: rows [row0, row0 + rows) and columns
// [col0, col0 + cols) of matrix `matrix`; its first element is local_offset in
// the shard, rows are `stride` elements apart; its factors start at
// left_offset / right_offset in the parameter's flat packed storage (the tiles'
// rows x rows and cols x cols symmetric matrices, packed_size each, in tile order).
struct Tile {
  size_t param;
  int64_t matrix, row0, rows, col0, cols;
  int64_t local_offset, stride;
  int64_t left_offset, right_offset;
  // >= 0: a tile of cut row `cut` (this rank owns it); local_offset is then in
  // that row's gathered buffer (its elements [begin, end)), not in the shard.
  int64_t cut = -1;
};

// A row of tiles (rows [row0, row0 + rows) of matrix `matrix`, all `cols`
// columns: elements [begin, end) of the flattened tensor) that shard boundaries
// cut. The owner is the rank holding `begin`, so each rank's tiles stay in the
// tensor's tile order (a checkpoint's sequence does not depend on the ranks).
struct CutTileRow {
  size_t param;
  int64_t matrix, row0, rows, cols;
  int64_t begin, end;
  int owner;
};

// Tile t of a flat tensor laid out as its shard (or a cut row's buffer): rows x
// cols, rows `stride` apart (a view).
inline at::Tensor tile_view(const at::Tensor& flat, const Tile& t) {
  return flat.as_strided({t.rows, t.cols}, {t.stride, 1}, flat.storage_offset() + t.local_offset);
}

// "parameter 'w' tile of matrix 0 rows [0, 4) columns [0, 8)", for messages.
std::string tile_name(const std::string& param_name, const Tile& t);

// The tiles that `shard` holds whole and (cut given, every rank's rows known)
// those of the cut rows it owns; every cut row of tiles of the tensor is
// appended to *cut (rank: this rank's index among the shard's ranks). Throws,
// naming the optimizer `who`, the parameter and the tile, and what keeps tiles
// whole (an rfsdp plan, or for FSDP2's chunk rows a max_preconditioner_dim that
// divides them), when the shard cuts a tile and cut is null or the other ranks'
// rows are unknown.
// The shape whose matrices (matrices.h) the shard's tiles cut: the tensor's own,
// or for one held in column parts (TensorShard::col_parts) its parts as a stack
// [parts, rows, width], whose rows the shard's are; their tiles are the global
// matrix's (part j's tile at column c is the global one at j * width + c) where
// max_dim divides the width. Throws, naming `who`, the parameter, the widths and
// what to do, where it does not.
std::vector<int64_t> tiling_shape(const char* who, const TensorShard& shard, int64_t max_dim);

std::vector<Tile> matrix_tiles(const char* who, const TensorShard& shard, size_t param,
                               int64_t max_dim, int rank = -1,
                               std::vector<CutTileRow>* cut = nullptr);

// The granule (rows of `shape` seen with row_dims) that keeps every tile on one rank.
int64_t tile_granule_rows(const std::vector<int64_t>& shape, int row_dims, int64_t max_dim);

// Symmetric matrices packed as upper triangles, row by row: the n x n matrix at
// `offset` of `flat` as a full fp32 matrix, and a full matrix packed (fp32).
// On the shard's device (a GPU: one gather / two scatters by a cached index).
at::Tensor unpack_symmetric(const at::Tensor& flat, int64_t offset, int64_t n);
at::Tensor pack_symmetric(const at::Tensor& full);

}  // namespace rfsdp
