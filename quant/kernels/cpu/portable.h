// The portable kernels of block-wise 8-bit quantisation (their loops compiled
// for AVX2 and a baseline, picked at load time), over blocks [b0, b1); chosen by
// cpu/kernels.cpp where the AVX-512 ones (cpu/avx512.h) cannot run.
// Contracts as cpu/kernels.h's entry points.
#pragma once

#include <atomic>
#include <cstdint>

#include "quant/formats/block_layout.h"
#include "quant/formats/code_lut.h"
#include "quant/kernels/adamw_update.h"

namespace rfsdp::quant::cpu::portable {

// *bad_any turns true when x holds NaN or Inf.
void quantize_blocks(const float* x, const BlockLayout& L, const CodeLut& lut, uint8_t* q,
                     float* absmax, int64_t b0, int64_t b1, std::atomic<bool>* bad_any);

void dequantize_blocks(const uint8_t* q, const float* absmax, const BlockLayout& L,
                       const float* code, float* out, int64_t b0, int64_t b1);

// mbuf, vbuf: L.max_block_elems() floats of scratch each.
void adamw8bit_blocks(float* p, const float* g, uint8_t* q1, float* absmax1, uint8_t* q2,
                      float* absmax2, const BlockLayout& L, const CodeLut& lut1,
                      const CodeLut& lut2, const AdamWCoeffs& c, int64_t b0, int64_t b1,
                      float* mbuf, float* vbuf);

// A step of blocks that ranks share, in two halves (cpu/kernels.h).
void adamw8bit_begin_blocks(float* p, const float* g, const uint8_t* q1, const float* absmax1,
                            const uint8_t* q2, const float* absmax2, const BlockLayout& L,
                            const CodeLut& lut1, const CodeLut& lut2, const AdamWCoeffs& c,
                            int64_t b0, int64_t b1, float* scratch, float* amax1, float* amax2);
void adamw8bit_end_blocks(const float* scratch, const BlockLayout& L, const CodeLut& lut1,
                          const CodeLut& lut2, const float* agreed1, const float* agreed2,
                          uint8_t* q1, float* absmax1, uint8_t* q2, float* absmax2, int64_t b0,
                          int64_t b1);

// Blocks [b0, b1) of momentum8bit_step (cpu/kernels.h); mbuf: L.max_block_elems() floats.
void momentum8bit_blocks(const float* g, const uint8_t* q, const float* absmax, const BlockLayout& L,
                         const CodeLut& lut, float beta, bool nesterov, uint8_t* q_out,
                         float* absmax_out, float* u, int64_t b0, int64_t b1, float* mbuf,
                         std::atomic<bool>* bad_any);
// Elements [i0, i1) of AdamW with fp32 moments.
void adamw32_range(float* p, const float* g, float* m, float* v, const AdamWCoeffs& c,
                   int64_t i0, int64_t i1);

}  // namespace rfsdp::quant::cpu::portable
