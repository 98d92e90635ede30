// Small pieces the C++ benches share: the median of samples, and a rank's
// shards of a planned model filled with random parameters and gradients.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/ragged/plan.h"
#include "optimizers/common/param_shard.h"

namespace rfsdp::bench {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// This rank's shards of `layers` identical units planned by `plan`, named
// "layer<l>.<tensor>", with N(0, 0.02) parameters and N(0, 1) gradients.
inline std::vector<ParamShard> random_shards(const Plan& plan, int layers, int rank) {
  std::vector<ParamShard> out;
  for (int l = 0; l < layers; ++l) {
    for (size_t i = 0; i < plan.tensors.size(); ++i) {
      const auto& t = plan.tensors[i];
      const auto r = plan.shard(i, rank);
      ParamShard p;
      p.name = "layer" + std::to_string(l) + "." + t.name;
      p.shape = t.shape;
      p.full_rows = t.rows();
      p.row_len = t.row_elems();
      p.row_begin = r.row_begin;
      p.row_end = r.row_end;
      const int64_t rows = r.row_end - r.row_begin;
      p.param = at::randn({rows, p.row_len}) * 0.02;
      p.grad = at::randn({rows, p.row_len});
      out.push_back(p);
    }
  }
  return out;
}

}  // namespace rfsdp::bench
