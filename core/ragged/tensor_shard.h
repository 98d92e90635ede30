// TensorShard: one rank's piece of a tensor, as every consumer sees it — the
// tensor's name, shape and row geometry, this rank's rows, and (where a plan
// made it) every rank's rows. fully_shard makes one per parameter from the
// plan; the optimizers, clipping and the checkpoint read it as it is (Python's
// rfsdp.ShardInfo is a view of it).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace rfsdp {

struct Plan;

struct TensorShard {
  std::string name;
  std::vector<int64_t> shape;  // the full tensor's
  int row_dims = 1;            // rows: the first row_dims dims flattened (TensorSpec's rule)
  int64_t full_rows = 0, row_len = 1;
  int64_t row_begin = 0, row_end = 0;  // this rank's rows
  // Every rank's [row_begin, row_end) in its group, in rank order; empty where
  // unknown (a shard described by hand: consumers that need them gather them).
  std::vector<std::pair<int64_t, int64_t>> rank_rows;
  // The tensor's logical blocks along each matrix's rows, where its plan keeps
  // them whole (TensorSpec::blocks; Muon's split); empty: none.
  std::vector<int64_t> blocks;
  int blocks_dim = 0;  // what the blocks split: 0 rows, 1 columns (TensorSpec::blocks_dim)
  // Column parts (tensor parallelism's Shard(1), RowwiseParallel's weights): a
  // 2-D tensor of `shape` cut into col_parts equal column blocks, each rank
  // holding rows of one. Rows are then those of the blocks one after another,
  // a [col_parts * shape[0], shape[1] / col_parts] tensor (row t * shape[0] + r
  // is row r of block t), so each rank's piece is a row range of it, in the
  // order the piece holds its elements. 1: none (rows are the tensor's own).
  int col_parts = 1;

  // Rows [row_begin, row_end) of a tensor of `shape` seen with row_dims. Throws
  // std::invalid_argument, naming the tensor, when row_dims or the rows are out of range.
  static TensorShard rows_of(std::string name, std::vector<int64_t> shape, int row_dims,
                             int64_t row_begin, int64_t row_end,
                             std::vector<std::pair<int64_t, int64_t>> rank_rows = {});
  // Rows [row_begin, row_end) of a 2-D tensor of `shape` held as `parts` column
  // parts (see col_parts; rows count over the parts one after another). Throws
  // std::invalid_argument, naming the tensor, unless parts divides its columns.
  static TensorShard column_parts(std::string name, std::vector<int64_t> shape, int parts,
                                  int64_t row_begin, int64_t row_end,
                                  std::vector<std::pair<int64_t, int64_t>> rank_rows = {});
  // The whole tensor (one rank holds all of it).
  static TensorShard whole(std::string name, std::vector<int64_t> shape, int row_dims = 1);
  // Tensor i of a plan on `rank`, with every rank's rows.
  static TensorShard of_plan(const Plan& plan, size_t i, int64_t rank);

  int64_t rows() const { return row_end - row_begin; }
  int64_t numel() const { return rows() * row_len; }
  int64_t full_numel() const { return full_rows * row_len; }
  bool knows_every_rank() const { return !rank_rows.empty(); }
  // The same shard under another name (what errors call it: the name the
  // model's named_parameters() gives, known once the outer fully_shard call ran).
  TensorShard renamed(std::string new_name) const {
    TensorShard s = *this;
    s.name = std::move(new_name);
    return s;
  }
};

}  // namespace rfsdp
