#include "core/ragged/tensor_shard.h"

#include <stdexcept>

#include "core/ragged/plan.h"
#include "core/ragged/tensor_spec.h"

namespace rfsdp {

TensorShard TensorShard::rows_of(std::string name, std::vector<int64_t> shape, int row_dims,
                                 int64_t row_begin, int64_t row_end,
                                 std::vector<std::pair<int64_t, int64_t>> rank_rows) {
  const int max_row_dims = shape.empty() ? 1 : static_cast<int>(shape.size());
  if (row_dims < 1 || row_dims > max_row_dims) {
    throw std::invalid_argument("tensor '" + name + "': row_dims " + std::to_string(row_dims) +
                                " is out of range [1, " + std::to_string(max_row_dims) +
                                "] for shape " + shape_to_string(shape));
  }
  TensorSpec t;
  t.shape = shape;
  t.row_dims = row_dims;
  TensorShard s;
  s.full_rows = t.rows();
  s.row_len = t.row_elems();
  if (row_begin < 0 || row_begin > row_end || row_end > s.full_rows) {
    throw std::invalid_argument("tensor '" + name + "': rows [" + std::to_string(row_begin) +
                                ", " + std::to_string(row_end) + ") do not lie in its " +
                                std::to_string(s.full_rows) + " rows (shape " +
                                shape_to_string(shape) + ")");
  }
  for (const auto& [b, e] : rank_rows) {
    if (b < 0 || b > e || e > s.full_rows) {
      throw std::invalid_argument("tensor '" + name + "': a rank's rows [" + std::to_string(b) +
                                  ", " + std::to_string(e) + ") do not lie in its " +
                                  std::to_string(s.full_rows) + " rows");
    }
  }
  s.name = std::move(name);
  s.shape = std::move(shape);
  s.row_dims = row_dims;
  s.row_begin = row_begin;
  s.row_end = row_end;
  s.rank_rows = std::move(rank_rows);
  return s;
}

TensorShard TensorShard::column_parts(std::string name, std::vector<int64_t> shape, int parts,
                                      int64_t row_begin, int64_t row_end,
                                      std::vector<std::pair<int64_t, int64_t>> rank_rows) {
  if (shape.size() != 2 || parts < 1 || shape[1] % parts != 0) {
    throw std::invalid_argument("tensor '" + name + "' of shape " + shape_to_string(shape) +
                                ": " + std::to_string(parts) + " column parts need a 2-D tensor "
                                "whose columns they divide");
  }
  TensorShard s = rows_of(name, {shape[0] * parts, shape[1] / parts}, 1, row_begin, row_end,
                          std::move(rank_rows));
  s.shape = std::move(shape);
  s.col_parts = parts;
  return s;
}

TensorShard TensorShard::whole(std::string name, std::vector<int64_t> shape, int row_dims) {
  TensorSpec t;
  t.shape = shape;
  t.row_dims = row_dims;
  const int64_t rows = shape.empty() || row_dims <= static_cast<int>(shape.size()) ? t.rows() : 0;
  return rows_of(std::move(name), std::move(shape), row_dims, 0, rows);
}

TensorShard TensorShard::of_plan(const Plan& plan, size_t i, int64_t rank) {
  const TensorSpec& t = plan.tensors.at(i);
  std::vector<std::pair<int64_t, int64_t>> every;
  for (int64_t r = 0; r < plan.world_size; ++r) {
    const ShardRange s = plan.shard(i, r);
    every.emplace_back(s.row_begin, s.row_end);
  }
  const ShardRange mine = plan.shard(i, rank);
  TensorShard s = rows_of(t.name, t.shape, t.row_dims, mine.row_begin, mine.row_end, std::move(every));
  s.blocks = t.blocks;
  s.blocks_dim = t.blocks_dim;
  return s;
}

}  // namespace rfsdp
