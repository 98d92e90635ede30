// The matrices of a parameter, as the structure-aware optimizers see them:
// 3-D, an expert stack [E, H, I] of E matrices H x I; any other shape, one
// matrix of dim 0 x the rest (a 1-D tensor: n x 1; 0-D: 1 x 1). Each matrix is
// a contiguous element range of the flattened tensor.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace rfsdp {

struct MatrixView {
  int64_t offset;  // first element in the flattened tensor
  int64_t rows, cols;
};

inline std::vector<MatrixView> matrices_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<MatrixView> out;
  if (shape.size() == 3) {
    for (int64_t e = 0; e < shape[0]; ++e) {
      out.push_back({e * shape[1] * shape[2], shape[1], shape[2]});
    }
  } else if (shape.empty()) {
    out.push_back({0, 1, 1});
  } else {
    out.push_back({0, shape[0], n / std::max<int64_t>(shape[0], 1)});
  }
  return out;
}

}  // namespace rfsdp
