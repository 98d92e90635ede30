// Block-wise 8-bit quantisation of tensors (ATen level): codes (uint8, the
// tensor's shape) and one float32 absmax per block.
#pragma once

#include <ATen/ATen.h>

#include "quant/formats/block_layout.h"

namespace rfsdp::quant {

struct Quantized {
  at::Tensor codes;   // uint8, shape of the input
  at::Tensor absmax;  // float32 [num_blocks]
};

// x: float32. row_len: elements per row for tiles (the tensor seen as
// rows x row_len); ignored for 1-D blocks. Default: the last dim (1 for 1-D).
// NaN or Inf in x is an error. keep_nonzero: values above 0 never take the code
// 0 (CodeLut; the rounding of Adam's second moments).
Quantized quantize_blockwise(const at::Tensor& x, const at::Tensor& code, BlockShape shape,
                             int64_t row_len = -1, bool keep_nonzero = false);

// Into `out` when given (float32, CPU, contiguous, as many elements as the
// codes; returned), else into a new tensor of the codes' shape.
at::Tensor dequantize_blockwise(const Quantized& q, const at::Tensor& code, BlockShape shape,
                                int64_t row_len = -1, const at::Tensor& out = {});

// The same with a Codec (state_ops.h): a code map or the float8_e4m3fn format
// (its keep_nonzero as the Codec holds it).
class Codec;
Quantized quantize_blockwise(const at::Tensor& x, const Codec& code, BlockShape shape,
                             int64_t row_len = -1);
at::Tensor dequantize_blockwise(const Quantized& q, const Codec& code, BlockShape shape,
                                int64_t row_len = -1, const at::Tensor& out = {});

// The layout of x's blocks (checks the arguments).
BlockLayout layout_of(const at::Tensor& x, BlockShape shape, int64_t row_len);

}  // namespace rfsdp::quant
