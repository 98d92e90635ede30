#include "core/ragged/tensor_spec.h"

#include <algorithm>

#include <stdexcept>
#include <unordered_set>

#include "core/ragged/int_math.h"

namespace rfsdp {

namespace {
int64_t product(const std::vector<int64_t>& shape, size_t begin, size_t end) {
  int64_t p = 1;
  for (size_t i = begin; i < end; ++i) p *= shape[i];
  return p;
}
}  // namespace

int64_t TensorSpec::numel() const { return product(shape, 0, shape.size()); }

int64_t TensorSpec::rows() const {
  if (shape.empty()) return 1;
  return product(shape, 0, static_cast<size_t>(row_dims));
}

int64_t TensorSpec::row_elems() const {
  if (shape.empty()) return 1;
  return product(shape, static_cast<size_t>(row_dims), shape.size());
}

int64_t TensorSpec::effective_granule_rows() const {
  const int64_t r = rows();
  return granule_rows >= r ? r : granule_rows;
}

int64_t block_granule_rows(const std::string& name, const std::vector<int64_t>& shape,
                           int row_dims, const std::vector<int64_t>& blocks, int blocks_dim) {
  const std::string who = "tensor '" + name + "': ";
  if (shape.size() < 2) {
    throw std::invalid_argument(who + "logical blocks need a matrix (2-D) or a 3-D stack, got shape " +
                                shape_to_string(shape));
  }
  if (blocks_dim != 0 && blocks_dim != 1) {
    throw std::invalid_argument(who + "logical blocks split a matrix's rows (split_dim 0) or its "
                                "columns (split_dim 1), got split_dim " + std::to_string(blocks_dim));
  }
  const bool stack = shape.size() == 3;
  // one matrix's rows, or columns (a matrix of more dims: dim 0 x the rest)
  int64_t extent = stack ? shape[1] : shape[0];
  if (blocks_dim == 1) {
    extent = 1;
    for (size_t d = stack ? 2 : 1; d < shape.size(); ++d) extent *= shape[d];
  }
  const char* unit = blocks_dim == 1 ? " columns" : " rows";
  int64_t sum = 0;
  for (int64_t b : blocks) {
    if (b < 1) {
      throw std::invalid_argument(who + "logical blocks must be positive " +
                                  (blocks_dim == 1 ? "column" : "row") + " counts, got " +
                                  std::to_string(b));
    }
    sum += b;
  }
  if (sum != extent) {
    throw std::invalid_argument(who + "logical blocks sum to " + std::to_string(sum) + unit + ", its " +
                                (stack ? "experts have " : "matrix has ") + std::to_string(extent) +
                                (blocks_dim == 0 ? " (split_dim 0 splits rows; 1 splits columns)" : ""));
  }
  if (blocks_dim == 1) {  // a column block spans every row of its matrix: whole matrices
    if (stack) return row_dims == 1 ? 1 : shape[1];
    return kWholeTensor;
  }
  const bool equal = std::all_of(blocks.begin(), blocks.end(), [&](int64_t b) { return b == blocks[0]; });
  if (stack) {
    if (row_dims == 1) return 1;  // a row is a whole expert
    return equal ? blocks[0] : extent;
  }
  // (rows of a 2-D tensor beyond dim 0 with row_dims 2: not a matrix's rows)
  return equal ? blocks[0] : kWholeTensor;
}

void check_tensor_spec(const TensorSpec& t) {
  const std::string who = "tensor '" + t.name + "': ";
  if (t.name.empty()) throw std::invalid_argument("a tensor has an empty name");
  for (size_t i = 0; i < t.shape.size(); ++i) {
    if (t.shape[i] <= 0) {
      throw std::invalid_argument(who + "dim " + std::to_string(i) + " is " +
                                  std::to_string(t.shape[i]) + " in shape " +
                                  shape_to_string(t.shape) + "; every dim must be positive");
    }
  }
  const int max_row_dims = t.shape.empty() ? 1 : static_cast<int>(t.shape.size());
  if (t.row_dims < 1 || t.row_dims > max_row_dims) {
    throw std::invalid_argument(who + "row_dims " + std::to_string(t.row_dims) +
                                " is out of range [1, " + std::to_string(max_row_dims) +
                                "] for shape " + shape_to_string(t.shape));
  }
  if (t.granule_rows < 1) {
    throw std::invalid_argument(who + "granule_rows must be a positive integer or \"whole\", got " +
                                std::to_string(t.granule_rows));
  }
  if (!t.blocks.empty()) {  // every rank boundary (a multiple of the granule) on a block edge
    const int64_t need = block_granule_rows(t.name, t.shape, t.row_dims, t.blocks, t.blocks_dim);
    const int64_t per = t.shape.size() == 3 && t.row_dims == 2 ? t.shape[1]
                        : t.shape.size() == 3 ? 1 : t.rows();  // rows of one matrix
    std::vector<int64_t> edges{0};
    if (t.blocks_dim == 0) {
      for (int64_t b : t.blocks) edges.push_back(edges.back() + b);
    }  // (column blocks: only matrix edges)
    const int64_t g = t.effective_granule_rows();
    if (t.shape.size() != 3 || t.row_dims == 2) {
      for (int64_t at = g; at < t.rows(); at += g) {
        if (!std::binary_search(edges.begin(), edges.end(), at % per)) {
          throw std::invalid_argument(
              who + "granule_rows " + granule_to_string(t) + " puts a rank boundary at row " +
              std::to_string(at) + ", inside one of its logical " +
              (t.blocks_dim == 1 ? "column blocks (they span every row of a matrix)"
                                 : "blocks") + "; use " +
              (need == kWholeTensor ? std::string("\"whole\"") : std::to_string(need)) +
              " (or a multiple of it)");
        }
      }
    }
  }
  if (t.elem_bytes < 1 || t.elem_bytes > kMaxElemBytes) {
    throw std::invalid_argument(who + "dtype_bytes must be between 1 and " +
                                std::to_string(kMaxElemBytes) + ", got " +
                                std::to_string(t.elem_bytes));
  }
  // Guard the element count against int64 overflow (buffers are addressed in int64).
  int64_t n = 1;
  for (int64_t d : t.shape) {
    if (n > std::numeric_limits<int64_t>::max() / 16 / d) {
      throw std::invalid_argument(who + "shape " + shape_to_string(t.shape) + " is too large");
    }
    n *= d;
  }
}

void check_unit_specs(const std::vector<TensorSpec>& tensors) {
  if (tensors.empty()) throw std::invalid_argument("the unit is empty: give it at least one tensor");
  std::unordered_set<std::string> names;
  for (const TensorSpec& t : tensors) {
    check_tensor_spec(t);
    if (!names.insert(t.name).second) {
      throw std::invalid_argument("tensor '" + t.name + "': duplicate name in the unit");
    }
    if (t.elem_bytes != tensors.front().elem_bytes) {
      throw std::invalid_argument(
          "tensor '" + t.name + "': dtype_bytes " + std::to_string(t.elem_bytes) + " differs from '" +
          tensors.front().name + "' (" + std::to_string(tensors.front().elem_bytes) +
          "); plan each dtype's tensors as a unit of its own (one flat buffer per dtype)");
    }
  }
}

int64_t combine_granules(int64_t a_rows, int64_t b_rows, int64_t tensor_rows) {
  if (a_rows < 1 || b_rows < 1) {
    throw std::invalid_argument("granules must be positive integers or \"whole\"");
  }
  if (a_rows >= tensor_rows || b_rows >= tensor_rows) return kWholeTensor;
  const int64_t l = lcm_capped(a_rows, b_rows, tensor_rows);
  return l >= tensor_rows ? kWholeTensor : l;
}

std::string granule_to_string(const TensorSpec& t) {
  return t.is_whole() ? "whole" : std::to_string(t.effective_granule_rows());
}

std::string shape_to_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

}  // namespace rfsdp
