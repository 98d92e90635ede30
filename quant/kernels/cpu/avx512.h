// The AVX-512 (F, BW, VBMI) kernels of block-wise 8-bit quantisation; chosen
// at run time by cpu/kernels.cpp where the CPU has them. Same contracts as the
// portable kernels (cpu/kernels.h), over blocks [b0, b1); the nearest code
// comes from the code's arithmetic index (code_index.h), so quantising needs
// lut.index(). Codes and midpoints are looked up in registers (byte planes and
// vpermi2b), not with gathers, which are slow on several of these CPUs.
#pragma once

#include <cstdint>

#include "quant/formats/block_layout.h"
#include "quant/formats/code_lut.h"
#include "quant/kernels/adamw_update.h"

namespace rfsdp::quant::cpu::avx512 {

// Whether this CPU (and OS) runs these kernels.
bool supported();

// *bad turns true when x holds NaN or Inf.
void quantize_blocks(const float* x, const BlockLayout& L, const CodeLut& lut, uint8_t* q,
                     float* absmax, int64_t b0, int64_t b1, bool* bad);

void dequantize_blocks(const uint8_t* q, const float* absmax, const BlockLayout& L,
                       const CodeLut& lut, float* out, int64_t b0, int64_t b1);

// buf: 4 * L.max_block_elems() floats of scratch (two blocks' m and v).
void adamw8bit_blocks(float* p, const float* g, uint8_t* q1, float* absmax1, uint8_t* q2,
                      float* absmax2, const BlockLayout& L, const CodeLut& lut1,
                      const CodeLut& lut2, const AdamWCoeffs& c, int64_t b0, int64_t b1,
                      float* buf);

// A step of blocks that ranks share, in two halves (cpu/kernels.h).
void adamw8bit_begin_blocks(float* p, const float* g, const uint8_t* q1, const float* absmax1,
                            const uint8_t* q2, const float* absmax2, const BlockLayout& L,
                            const CodeLut& lut1, const CodeLut& lut2, const AdamWCoeffs& c,
                            int64_t b0, int64_t b1, float* scratch, float* amax1, float* amax2);
void adamw8bit_end_blocks(const float* scratch, const BlockLayout& L, const CodeLut& lut1,
                          const CodeLut& lut2, const float* agreed1, const float* agreed2,
                          uint8_t* q1, float* absmax1, uint8_t* q2, float* absmax2, int64_t b0,
                          int64_t b1);

// Blocks [b0, b1) of momentum8bit_step (cpu/kernels.h); mbuf: L.max_block_elems()
// floats of scratch; *bad turns true when the new momentum holds NaN or Inf.
void momentum8bit_blocks(const float* g, const uint8_t* q, const float* absmax, const BlockLayout& L,
                         const CodeLut& lut, float beta, bool nesterov, uint8_t* q_out,
                         float* absmax_out, float* u, int64_t b0, int64_t b1, float* mbuf,
                         bool* bad);

}  // namespace rfsdp::quant::cpu::avx512
