// A parameter as an optimizer sees it: this rank's rows of a tensor. Every
// optimizer takes these; FSDP units and whole tensors give them.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "fsdp/fsdp_unit.h"

namespace rfsdp {

// Rows [row_begin, row_begin + rows) of a tensor of full_rows rows of row_len
// elements. param and grad: fp32, contiguous, that many elements (any shape).
struct ParamShard {
  std::string name;
  at::Tensor param, grad;
  int64_t full_rows = 0, row_len = 1, row_begin = 0;
  std::vector<int64_t> shape;  // the full tensor's shape (Muon reads matrices from it)

  int64_t rows() const { return row_len ? param.numel() / row_len : 0; }
  int64_t full_numel() const { return full_rows * row_len; }
};

// Throws, naming the optimizer and the parameter, unless grad is undefined (no
// step) or a contiguous float32 CPU tensor of the shard's size.
void check_grad(const char* optimizer, const ParamShard& p, const at::Tensor& grad);

// A whole (unsharded) tensor: rows from its first row_dims dims.
ParamShard whole_param(const std::string& name, const at::Tensor& param, const at::Tensor& grad,
                       int row_dims = 1);
// The local shards of an FSDP unit's parameters (views of its local slices).
std::vector<ParamShard> param_shards(const FSDPUnit& unit);

}  // namespace rfsdp
