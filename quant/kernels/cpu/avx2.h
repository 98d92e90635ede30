// The AVX2 (+FMA) kernels of block-wise 8-bit quantisation, for CPUs without
// AVX-512 VBMI (AMD Zen 2/3, Intel before Ice Lake); chosen at run time by
// cpu/kernels.cpp. Same contracts as the portable kernels (cpu/kernels.h), over
// blocks [b0, b1), bit for bit: the nearest code from the table's entry by a
// value's top 16 bits (one gather: CodeLut::entry_by_top16) where the table is
// exact, else from the code's arithmetic index (code_index.h: its binade keys and
// level coefficients in registers, the midpoint by a gather), so quantising needs
// lut.index(); codes decoded by a gather; the AdamW and lerp arithmetic as
// adamw_update.h writes it (no FMA there).
#pragma once

#include <cstdint>

#include "quant/formats/block_layout.h"
#include "quant/formats/code_lut.h"
#include "quant/kernels/adamw_update.h"

namespace rfsdp::quant::cpu::avx2 {

// Whether this CPU (and OS) runs these kernels (AVX2 and FMA).
bool supported();

// *bad turns true when x holds NaN or Inf.
void quantize_blocks(const float* x, const BlockLayout& L, const CodeLut& lut, uint8_t* q,
                     float* absmax, int64_t b0, int64_t b1, bool* bad);
void dequantize_blocks(const uint8_t* q, const float* absmax, const BlockLayout& L,
                       const CodeLut& lut, float* out, int64_t b0, int64_t b1);
// mbuf, vbuf: L.max_block_elems() floats of scratch each.
void adamw8bit_blocks(float* p, const float* g, uint8_t* q1, float* absmax1, uint8_t* q2,
                      float* absmax2, const BlockLayout& L, const CodeLut& lut1,
                      const CodeLut& lut2, const AdamWCoeffs& c, int64_t b0, int64_t b1,
                      float* mbuf, float* vbuf);
void adamw8bit_begin_blocks(float* p, const float* g, const uint8_t* q1, const float* absmax1,
                            const uint8_t* q2, const float* absmax2, const BlockLayout& L,
                            const CodeLut& lut1, const CodeLut& lut2, const AdamWCoeffs& c,
                            int64_t b0, int64_t b1, float* scratch, float* amax1, float* amax2);
void adamw8bit_end_blocks(const float* scratch, const BlockLayout& L, const CodeLut& lut1,
                          const CodeLut& lut2, const float* agreed1, const float* agreed2,
                          uint8_t* q1, float* absmax1, uint8_t* q2, float* absmax2, int64_t b0,
                          int64_t b1);
void momentum8bit_blocks(const float* g, const uint8_t* q, const float* absmax, const BlockLayout& L,
                         const CodeLut& lut, float beta, bool nesterov, uint8_t* q_out,
                         float* absmax_out, float* u, int64_t b0, int64_t b1, float* mbuf,
                         bool* bad);

}  // namespace rfsdp::quant::cpu::avx2
