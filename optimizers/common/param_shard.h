// What the optimizers check of a ParamShard (core/ragged/param_shard.h), and
// whole tensors as shards. FSDP units give theirs with param_shards(unit)
// (fsdp/fsdp_unit.h).
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "core/ragged/param_shard.h"

namespace rfsdp {

class Comm;

// Throws, naming the optimizer and the parameter, unless grad is undefined (no
// step) or a contiguous float32 (or the parameter's dtype) tensor of the shard's
// size on the parameter's device.
void check_grad(const char* optimizer, const ParamShard& p, const at::Tensor& grad);

// A whole (unsharded) tensor: rows from its first row_dims dims.
ParamShard whole_param(const std::string& name, const at::Tensor& param, const at::Tensor& grad,
                       int row_dims = 1);

// Every rank's rows, filled in where a shard does not know them for comm's
// ranks (one described by hand, a whole tensor on every rank: DDP; an HSDP
// shard group's rows seen from the whole world): one all-reduce of every rank's
// rows of every parameter, only where some shard lacks them and comm has more
// than one rank (build the optimizer from the same model on every rank). Throws
// std::invalid_argument on every rank where the ranks hold different numbers of
// parameters. Rows a shard knows are kept (its consumer agrees them).
// Throws std::invalid_argument, naming the optimizer and the parameter, where p
// is held in column parts (TensorShard::col_parts: tensor parallelism's Shard(1))
// and `what` (blocks, tiles) needs the tensor's own rows.
void require_own_rows(const char* optimizer, const TensorShard& p, const char* what);

void gather_rank_rows(Comm* comm, std::vector<ParamShard>* params, const char* who);

}  // namespace rfsdp
