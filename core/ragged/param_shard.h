// ParamShard: a parameter as the optimizers see it, and as FSDP units and
// whole tensors give it — this rank's piece of a tensor (its TensorShard:
// shape, rows, every rank's rows where a plan made it) and the tensors that
// hold it. Header-only: the layout model's one use of ATen (views), so that
// fsdp/ makes these and optimizers/ takes them without either needing the other.
#pragma once

#include <ATen/ATen.h>

#include <utility>

#include "core/ragged/tensor_shard.h"

namespace rfsdp {

// param and grad: fp32, contiguous, rows() * row_len elements (any shape).
struct ParamShard : TensorShard {
  at::Tensor param, grad;

  ParamShard() = default;
  ParamShard(TensorShard shard, at::Tensor param, at::Tensor grad = {})
      : TensorShard(std::move(shard)), param(std::move(param)), grad(std::move(grad)) {}
};

}  // namespace rfsdp
