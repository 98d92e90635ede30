// CUDA kernels of block-wise 8-bit quantisation, over raw device pointers and
// a stream (no ATen: this library builds wherever nvcc is, and runs on a GPU).
// A thread block of 256 threads takes one quantisation block at a time (at most
// 4096 elements: 1-D blocks up to 4096, tiles up to 64x64), walking them grid-
// stride; the 256-value code lives in shared memory, loaded once per thread block.
// The nearest code: the code's arithmetic index (code_index.h; the same
// arithmetic as the CPU kernels, so the same codes) where `index` is given
// (CodeLut::index()), else a binary search over the midpoints; the midpoints
// follow CodeLut's (code_midpoint: keep_nonzero included).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "quant/formats/block_layout.h"
#include "quant/formats/code_index.h"
#include "quant/kernels/adamw_update.h"

namespace rfsdp::quant::cuda {

constexpr int64_t kMaxBlockElems = 4096;

// How values round to a code: its arithmetic index (null: search the
// midpoints) and CodeLut::keep_nonzero.
struct CodeRounding {
  const CodeIndex* index = nullptr;
  bool keep_nonzero = false;
};

cudaError_t quantize(const float* x, const BlockLayout& layout, const float* code,
                     CodeRounding rounding, uint8_t* q, float* absmax, cudaStream_t stream);

cudaError_t dequantize(const uint8_t* q, const float* absmax, const BlockLayout& layout,
                       const float* code, float* out, cudaStream_t stream);

// The fused AdamW8bit step: per block, codes/gradient/parameter read once,
// moments updated in fp32 registers, codes and parameter written once.
cudaError_t adamw8bit_step(float* param, const float* grad, uint8_t* q1, float* absmax1,
                           uint8_t* q2, float* absmax2, const BlockLayout& layout,
                           const float* code1, CodeRounding rounding1, const float* code2,
                           CodeRounding rounding2, const AdamWHyper& h, cudaStream_t stream);

// adamw8bit_step for blocks that ranks share, in two halves around the agreement
// of each block's absmax (as cpu/kernels.h's): scratch holds 2 * num_blocks *
// max_block_elems floats; amax1, amax2 and agreed1, agreed2 one per block.
cudaError_t adamw8bit_begin(float* param, const float* grad, const uint8_t* q1,
                            const float* absmax1, const uint8_t* q2, const float* absmax2,
                            const BlockLayout& layout, const float* code1, const float* code2,
                            const AdamWHyper& h, float* scratch, float* amax1, float* amax2,
                            cudaStream_t stream);
cudaError_t adamw8bit_end(const float* scratch, const BlockLayout& layout, const float* code1,
                          CodeRounding rounding1, const float* code2, CodeRounding rounding2,
                          const float* agreed1, const float* agreed2, uint8_t* q1, float* absmax1,
                          uint8_t* q2, float* absmax2, cudaStream_t stream);

// The same operations for the float8_e4m3fn format (formats/fp8_e4m3.h):
// AdamW's m signed, v keep_nonzero.
cudaError_t quantize_fp8(const float* x, const BlockLayout& layout, bool keep_nonzero, uint8_t* q,
                         float* absmax, cudaStream_t stream);
cudaError_t dequantize_fp8(const uint8_t* q, const float* absmax, const BlockLayout& layout,
                           float* out, cudaStream_t stream);
cudaError_t adamw_fp8_step(float* param, const float* grad, uint8_t* q1, float* absmax1,
                           uint8_t* q2, float* absmax2, const BlockLayout& layout,
                           const AdamWHyper& h, cudaStream_t stream);
cudaError_t adamw_fp8_begin(float* param, const float* grad, const uint8_t* q1,
                            const float* absmax1, const uint8_t* q2, const float* absmax2,
                            const BlockLayout& layout, const AdamWHyper& h, float* scratch,
                            float* amax1, float* amax2, cudaStream_t stream);
cudaError_t adamw_fp8_end(const float* scratch, const BlockLayout& layout, const float* agreed1,
                          const float* agreed2, uint8_t* q1, float* absmax1, uint8_t* q2,
                          float* absmax2, cudaStream_t stream);

}  // namespace rfsdp::quant::cuda
