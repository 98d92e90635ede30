// The CUDA quantisation kernels behind ATen tensors on a GPU: checks, then a
// launch on the tensors' device and its current stream. A build without nvcc
// has no kernels: built() is false and every call throws saying so.
#pragma once

#include <ATen/ATen.h>

#include "quant/formats/block_layout.h"
#include "quant/formats/code_lut.h"
#include "quant/kernels/adamw_update.h"

namespace rfsdp::quant::cuda_ops {

bool built();

// code: the 256 code values (float32) on the tensors' device; lut: the same
// code's CPU table, for its arithmetic index (the kernels take it by value).
void quantize(const at::Tensor& x, const BlockLayout& layout, const at::Tensor& code,
              const cpu::CodeLut& lut, const at::Tensor& q, const at::Tensor& absmax);
void dequantize(const at::Tensor& q, const at::Tensor& absmax, const BlockLayout& layout,
                const at::Tensor& code, const at::Tensor& out);
void adamw8bit_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& q1,
                    const at::Tensor& absmax1, const at::Tensor& q2, const at::Tensor& absmax2,
                    const BlockLayout& layout, const at::Tensor& code1, const cpu::CodeLut& lut1,
                    const at::Tensor& code2, const cpu::CodeLut& lut2, const AdamWHyper& h);

// The step of blocks that ranks share, in two halves (cuda/kernels.h): scratch
// 2 * num_blocks * max_block_elems fp32; amax1, amax2, agreed1, agreed2 per block.
void adamw8bit_begin(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& q1,
                     const at::Tensor& absmax1, const at::Tensor& q2, const at::Tensor& absmax2,
                     const BlockLayout& layout, const at::Tensor& code1, const at::Tensor& code2,
                     const AdamWHyper& h, const at::Tensor& scratch, const at::Tensor& amax1,
                     const at::Tensor& amax2);
void adamw8bit_end(const at::Tensor& scratch, const BlockLayout& layout, const at::Tensor& code1,
                   const cpu::CodeLut& lut1, const at::Tensor& code2, const cpu::CodeLut& lut2,
                   const at::Tensor& agreed1, const at::Tensor& agreed2, const at::Tensor& q1,
                   const at::Tensor& absmax1, const at::Tensor& q2, const at::Tensor& absmax2);

// The float8_e4m3fn format (formats/fp8_e4m3.h; no code tensors).
void quantize_fp8(const at::Tensor& x, const BlockLayout& layout, bool keep_nonzero,
                  const at::Tensor& q, const at::Tensor& absmax);
void dequantize_fp8(const at::Tensor& q, const at::Tensor& absmax, const BlockLayout& layout,
                    const at::Tensor& out);
void adamw_fp8_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& q1,
                    const at::Tensor& absmax1, const at::Tensor& q2, const at::Tensor& absmax2,
                    const BlockLayout& layout, const AdamWHyper& h);
void adamw_fp8_begin(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& q1,
                     const at::Tensor& absmax1, const at::Tensor& q2, const at::Tensor& absmax2,
                     const BlockLayout& layout, const AdamWHyper& h, const at::Tensor& scratch,
                     const at::Tensor& amax1, const at::Tensor& amax2);
void adamw_fp8_end(const at::Tensor& scratch, const BlockLayout& layout, const at::Tensor& agreed1,
                   const at::Tensor& agreed2, const at::Tensor& q1, const at::Tensor& absmax1,
                   const at::Tensor& q2, const at::Tensor& absmax2);

}  // namespace rfsdp::quant::cuda_ops
