// A matrix held as tensor parallelism's column parts (RowwiseParallel's
// Shard(1): equal column blocks) under FSDP's row chunks, as the column-part
// tests of every optimizer put it on their thread ranks: rank r holds rows
// chunk[r] of column part r % parts.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <utility>
#include <vector>

#include "core/ragged/tensor_shard.h"

namespace rfsdp::testing {

struct ColumnPartsMatrix {
  std::string name;
  std::vector<int64_t> shape;
  int parts;
  std::vector<std::pair<int64_t, int64_t>> chunk;  // per rank: its rows of its part

  int part(int r) const { return r % parts; }
  int64_t width() const { return shape[1] / parts; }
  // Rank r's piece of a full matrix of this shape (a view).
  at::Tensor piece(const at::Tensor& full, int r) const {
    return full.narrow(1, part(r) * width(), width())
        .narrow(0, chunk[r].first, chunk[r].second - chunk[r].first);
  }
  // Rank r's shard: the parts' rows one after another, every rank's known.
  TensorShard shard(int r) const {
    std::vector<std::pair<int64_t, int64_t>> every;
    for (size_t q = 0; q < chunk.size(); ++q) {
      const int64_t base = part(static_cast<int>(q)) * shape[0];
      every.emplace_back(base + chunk[q].first, base + chunk[q].second);
    }
    return TensorShard::column_parts(name, shape, parts, every[r].first, every[r].second, every);
  }
};

}  // namespace rfsdp::testing
