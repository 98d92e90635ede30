// Moving a checkpoint's optimizer state between storage settings (8-bit blocks,
// low-bit bases, packed roots): what every optimizer's requantized_state shares.
// The saved state of a parameter arrives whole (every rank's pieces, as the
// checkpoint keeps them: state_layout.h), is decoded as the saved settings kept
// it, and this rank's part is encoded as the optimizer keeps it now.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

#include "core/ragged/tensor_shard.h"
#include "optimizers/common/state_layout.h"
#include "quant/ops.h"

namespace rfsdp {

// A parameter's state by name: a checkpoint's whole tensors, or this rank's.
using NamedState = std::map<std::string, at::Tensor>;

// full[name], or std::invalid_argument naming what is missing (`who`: the optimizer).
const at::Tensor& saved(const NamedState& full, const std::string& name, const char* who,
                        const TensorShard& shard);

// A whole tensor saved shaped like the parameter (the global order) as
// [full_rows, row_len] in the shard's rows: held in column parts
// (TensorShard::col_parts), the parts' rows one after another.
at::Tensor in_shard_rows(const TensorShard& shard, const at::Tensor& whole);

// This rank's rows of a whole tensor saved shaped like the parameter (flat, a copy).
at::Tensor rows_here(const TensorShard& shard, const at::Tensor& whole);

// This rank's piece of a saved global sequence laid out as `layout` (numel: the
// piece's elements; its runs one after another where it has them; a copy).
at::Tensor piece_here(const at::Tensor& whole, const StateLayout& layout, int64_t numel);

// The n x n matrices of tiles [r.first, r.end) on one side (left: rows x rows)
// from a saved per-tile sequence of them, fp32: entries n*n per tile (float32 or
// bfloat16), or where `format` is coded its codes (name + "_codes") and scales
// (name + "_absmax"), decoded and rectified as a step of that format uses them.
std::vector<at::Tensor> decode_squares(const NamedState& full, const std::string& name,
                                       const TileRange& r, bool left,
                                       const quant::LowBitFormat& format, const char* who,
                                       const TensorShard& shard);

// This rank's entries of the square matrices qs (fp32) stored as `format` keeps
// them (coded: name + "_codes" and name + "_absmax"), else as `dtype` entries
// (name), into *out.
void encode_squares(const std::vector<at::Tensor>& qs, const std::string& name,
                    const quant::LowBitFormat& format, at::ScalarType dtype, NamedState* out);

}  // namespace rfsdp
