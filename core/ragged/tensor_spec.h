// TensorSpec: one tensor of a unit as the planner sees it (shape, rows, granule).
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace rfsdp {

// granule_rows value meaning "never split this tensor". Any granule >= the
// tensor's row count means the same; kWholeTensor is its canonical spelling.
constexpr int64_t kWholeTensor = std::numeric_limits<int64_t>::max();

// The largest element size a spec may give (complex128 is 16 bytes): keeps the
// alignment's lcm with it, and the planner's byte counts, inside int64.
constexpr int64_t kMaxElemBytes = 1024;

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  int64_t elem_bytes = 4;
  // The first row_dims dims are flattened into rows; a row is prod(shape[row_dims:]).
  // A 0-dim tensor is one row of one element (row_dims must then be 1).
  int row_dims = 1;
  // Rank boundaries inside the tensor fall only at multiples of this many rows.
  int64_t granule_rows = 1;
  // Logical blocks along each matrix's rows (row counts summing to them: a 2-D
  // tensor's rows, a 3-D [E, H, I] stack's H; Muon's split_sizes: heads, a fused
  // QKV's q, k, v); empty: none. The granule must keep every block whole on one
  // rank (checked); the shards carry them to the optimizers.
  std::vector<int64_t> blocks;
  // The dim of each matrix the blocks split: 0 rows (above), 1 columns (column
  // counts summing to a matrix's columns: GPT-2's Conv1D fused QKV, stored
  // [in, 3 in]); column blocks are whole only where whole matrices are.
  int blocks_dim = 0;

  int64_t numel() const;
  int64_t rows() const;
  int64_t row_elems() const;
  // Granule rows capped at rows(): equal to rows() when the tensor is whole.
  int64_t effective_granule_rows() const;
  bool is_whole() const { return effective_granule_rows() == rows(); }
  // Elements of one full granule (the last granule of a tensor may be shorter).
  int64_t granule_elems() const { return effective_granule_rows() * row_elems(); }
};

// Throws std::invalid_argument naming the tensor when the spec is malformed:
// a zero or negative dim, row_dims out of range, a granule that is not a
// positive integer, an element size outside [1, kMaxElemBytes].
void check_tensor_spec(const TensorSpec& t);

// Checks a whole unit: non-empty, every spec valid, names unique, one element
// size (a unit keeps one flat buffer per dtype). Throws std::invalid_argument.
void check_unit_specs(const std::vector<TensorSpec>& tensors);

// The granule (rows, as row_dims sees them) that keeps every logical block of
// `blocks` whole: blocks of rows (blocks_dim 0), one block's rows when they are
// equal (rank boundaries at block edges), else whole matrices (a 3-D stack seen
// as E*H rows: H; else the whole tensor: kWholeTensor); blocks of columns
// (blocks_dim 1), whole matrices. Throws std::invalid_argument, naming the
// tensor, when the blocks are not positive or do not sum to the matrices' rows
// (columns), or blocks_dim is not 0 or 1.
int64_t block_granule_rows(const std::string& name, const std::vector<int64_t>& shape,
                           int row_dims, const std::vector<int64_t>& blocks, int blocks_dim = 0);

// Granules asked by several users of one tensor combine by lcm, capped at the
// whole tensor (any lcm >= rows, or one that overflows, is kWholeTensor).
int64_t combine_granules(int64_t a_rows, int64_t b_rows, int64_t tensor_rows);

// "whole" for whole tensors, else the number (as the JSON format spells it).
std::string granule_to_string(const TensorSpec& t);

std::string shape_to_string(const std::vector<int64_t>& shape);

}  // namespace rfsdp
