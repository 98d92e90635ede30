// What the tiled optimizers' tests (Shampoo, SOAP) share: their test tensors,
// the float64 references' tiles, and the shards they run on (a plan's, or
// FSDP2's chunk rows that cut tiles).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "core/ragged/plan.h"
#include "core/ragged/param_shard.h"
#include "optimizers/common/tiles.h"

namespace rfsdp {
namespace testing {

struct Case {
  std::string name;
  std::vector<int64_t> shape;
  int row_dims = 1;
  bool precondition = true;
};

// A tile of the float64 references: off, rows, cols, stride in the flat tensor;
// its factors l, r and its two side matrices (Shampoo's roots, SOAP's bases).
struct RefTile {
  int64_t off, rows, cols, stride;
  at::Tensor l, r, left, right;
};

inline at::Tensor ref_view(const at::Tensor& flat, const RefTile& t) {
  return flat.as_strided({t.rows, t.cols}, {t.stride, 1}, t.off);
}

// The tiles of a tensor of `shape` (B = max_dim) in tile order: zero factors,
// identity side matrices.
inline std::vector<RefTile> ref_tiles(const std::vector<int64_t>& shape, int64_t max_dim) {
  std::vector<RefTile> ts;
  if (shape.size() < 2) return ts;
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  const int64_t mats = shape.size() == 3 ? shape[0] : 1, h = shape.size() == 3 ? shape[1] : shape[0];
  const int64_t w = n / (mats * h);
  for (int64_t e = 0; e < mats; ++e) {
    for (int64_t r0 = 0; r0 < h; r0 += max_dim) {
      for (int64_t c0 = 0; c0 < w; c0 += max_dim) {
        RefTile tl;
        tl.off = e * h * w + r0 * w + c0;
        tl.rows = std::min(max_dim, h - r0);
        tl.cols = std::min(max_dim, w - c0);
        tl.stride = w;
        tl.l = at::zeros({tl.rows, tl.rows}, at::kDouble);
        tl.r = at::zeros({tl.cols, tl.cols}, at::kDouble);
        tl.left = at::eye(tl.rows, at::kDouble);
        tl.right = at::eye(tl.cols, at::kDouble);
        ts.push_back(tl);
      }
    }
  }
  return ts;
}

// Tensor i of a plan on `rank`: its shard of `full` (a copy).
inline ParamShard shard_of(const Plan& plan, size_t i, int rank, const at::Tensor& full) {
  const TensorSpec& t = plan.tensors[i];
  const ShardRange r = plan.shard(i, rank);
  return ParamShard(TensorShard::of_plan(plan, i, rank),
                    full.reshape(-1).narrow(0, r.row_begin * t.row_elems(), r.numel).clone());
}

// Case k's rows as torch.chunk splits them over `world` ranks (FSDP2's split,
// which cuts tiles), rank `rank`'s (a copy of `full`'s), with every rank's rows.
inline ParamShard chunk_shard_of(const Case& k, int world, int rank, const at::Tensor& full) {
  const TensorShard whole = TensorShard::whole(k.name, k.shape, k.row_dims);
  const int64_t rows = whole.full_rows, row_len = whole.row_len;
  const int64_t c = (rows + world - 1) / world;
  std::vector<std::pair<int64_t, int64_t>> every;
  for (int r = 0; r < world; ++r) every.push_back({std::min(r * c, rows), std::min((r + 1) * c, rows)});
  const auto [b, e] = every[rank];
  return ParamShard(TensorShard::rows_of(k.name, k.shape, k.row_dims, b, e, every),
                    full.reshape(-1).narrow(0, b * row_len, (e - b) * row_len).clone());
}

}  // namespace testing
}  // namespace rfsdp
