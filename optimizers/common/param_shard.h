// What the optimizers check of a ParamShard (core/ragged/param_shard.h), and
// whole tensors as shards. FSDP units give theirs with param_shards(unit)
// (fsdp/fsdp_unit.h).
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "core/ragged/param_shard.h"

namespace rfsdp {

// Throws, naming the optimizer and the parameter, unless grad is undefined (no
// step) or a contiguous float32 (or the parameter's dtype) tensor of the shard's
// size on the parameter's device.
void check_grad(const char* optimizer, const ParamShard& p, const at::Tensor& grad);

// A whole (unsharded) tensor: rows from its first row_dims dims.
ParamShard whole_param(const std::string& name, const at::Tensor& param, const at::Tensor& grad,
                       int row_dims = 1);

}  // namespace rfsdp
