#include "optimizers/common/requantize.h"

#include <stdexcept>

namespace rfsdp {

const at::Tensor& saved(const NamedState& full, const std::string& name, const char* who,
                        const TensorShard& shard) {
  const auto it = full.find(name);
  if (it == full.end()) {
    throw std::invalid_argument(std::string(who) + ": the saved state of parameter '" + shard.name +
                                "' has no '" + name + "' (saved by another optimizer, or with "
                                "settings that keep other states?)");
  }
  return it->second;
}

at::Tensor in_shard_rows(const TensorShard& shard, const at::Tensor& whole) {
  if (shard.col_parts == 1) return whole.reshape({shard.full_rows, shard.row_len});
  const int64_t parts = shard.col_parts;
  return whole.reshape({shard.full_rows / parts, parts, shard.row_len})
      .permute({1, 0, 2})
      .reshape({shard.full_rows, shard.row_len});
}

at::Tensor rows_here(const TensorShard& shard, const at::Tensor& whole) {
  return in_shard_rows(shard, whole).narrow(0, shard.row_begin, shard.rows()).reshape(-1).clone();
}

at::Tensor piece_here(const at::Tensor& whole, const StateLayout& layout, int64_t numel) {
  const at::Tensor flat = whole.reshape(-1);
  if (layout.runs.empty()) return flat.narrow(0, layout.offset, numel).clone();
  std::vector<at::Tensor> runs;
  for (const auto& [o, n] : layout.runs) runs.push_back(flat.narrow(0, o, n));
  return at::cat(runs);
}

std::vector<at::Tensor> decode_squares(const NamedState& full, const std::string& name,
                                       const TileRange& r, bool left,
                                       const quant::LowBitFormat& format, const char* who,
                                       const TensorShard& shard) {
  std::vector<int64_t> sizes;
  for (const Tile& t : r.all) sizes.push_back(left ? t.rows : t.cols);
  std::vector<at::Tensor> out;
  if (!format.coded()) {
    const at::Tensor flat = saved(full, name, who, shard).reshape(-1);
    int64_t at = 0;
    for (size_t k = 0; k < sizes.size(); ++k) {
      const int64_t n = sizes[k];
      if (k >= r.first && k < r.end) out.push_back(flat.narrow(0, at, n * n).to(at::kFloat).view({n, n}));
      at += n * n;
    }
    return out;
  }
  // The whole tensor's tiles as the saved optimizer kept them, decoded as it did.
  quant::LowbitSquares squares(sizes, format, at::TensorOptions(at::kFloat));
  squares.codes().copy_(saved(full, name + "_codes", who, shard).reshape(-1));
  squares.absmax().copy_(saved(full, name + "_absmax", who, shard).reshape(-1));
  for (size_t k = r.first; k < r.end; ++k) out.push_back(squares.orthogonal(k));
  return out;
}

void encode_squares(const std::vector<at::Tensor>& qs, const std::string& name,
                    const quant::LowBitFormat& format, at::ScalarType dtype, NamedState* out) {
  if (!format.coded()) {
    std::vector<at::Tensor> flat;
    for (const at::Tensor& q : qs) flat.push_back(q.reshape(-1));
    (*out)[name] = flat.empty() ? at::zeros({0}, at::TensorOptions(dtype)) : at::cat(flat).to(dtype);
    return;
  }
  std::vector<int64_t> sizes;
  for (const at::Tensor& q : qs) sizes.push_back(q.size(0));
  quant::LowbitSquares squares(sizes, format, at::TensorOptions(at::kFloat));
  for (size_t k = 0; k < qs.size(); ++k) squares.store(k, qs[k].to(at::kFloat));
  (*out)[name + "_codes"] = squares.codes();
  (*out)[name + "_absmax"] = squares.absmax();
}

}  // namespace rfsdp
