// CPU kernels of block-wise 8-bit quantisation, over raw pointers: the entry
// points and the choice between the implementations. Threads run over blocks
// (ATen's pool). AVX-512 (F, BW, VBMI: cpu/avx512.cpp) where the CPU has
// it, else AVX2 with FMA (cpu/avx2.cpp), else the portable one
// (cpu/portable.cpp: its loops compiled for AVX2 and a baseline). All
// give the same bits (tests compare them): the nearest code by the same midpoints,
// the arithmetic as adamw_update.h and torch.lerp write it, no FMA contraction.
#pragma once

#include <cstdint>

#include "quant/formats/block_layout.h"
#include "quant/formats/code_lut.h"
#include "quant/kernels/adamw_update.h"

namespace rfsdp::quant::cpu {

// The kernels in use. Default: the best this CPU runs, unless the environment
// sets RFSDP_QUANT_ISA=portable or =avx2 (a lesser set this CPU runs). use_isa
// switches (tests, benches); it throws std::invalid_argument for kernels this CPU
// cannot run.
enum class Isa { kPortable, kAvx2, kAvx512 };
Isa active_isa();
bool isa_supported(Isa isa);
void use_isa(Isa isa);
const char* isa_name(Isa isa);

// Quantises x (laid out as `layout`) into q (one byte per element) and absmax
// (one per block). Returns false if x holds NaN or Inf (the outputs are then
// written but meaningless).
bool quantize(const float* x, const BlockLayout& layout, const CodeLut& lut, uint8_t* q,
              float* absmax);

void dequantize(const uint8_t* q, const float* absmax, const BlockLayout& layout,
                const CodeLut& lut, float* out);

// One AdamW step with 8-bit block-wise moments, fused: per block, read the
// codes, the gradient and the parameter once, update in fp32, write back.
void adamw8bit_step(float* param, const float* grad, uint8_t* q1, float* absmax1, uint8_t* q2,
                    float* absmax2, const BlockLayout& layout, const CodeLut& lut1,
                    const CodeLut& lut2, const AdamWHyper& h);

// adamw8bit_step for blocks that ranks share (a shard boundary cuts them), in
// two halves around the agreement of each block's absmax. begin: the parameter
// updated, this rank's elements of the new moments kept in `scratch`
// (2 * L.num_blocks * L.max_block_elems() floats), their max |.| per block in
// amax1, amax2 (the codes are untouched). end: the codes under the agreed absmax
// (the max over the ranks sharing each block), stored in absmax1, absmax2. With
// every block whole and agreed = amax, the two are adamw8bit_step bit for bit.
void adamw8bit_begin(float* param, const float* grad, const uint8_t* q1, const float* absmax1,
                     const uint8_t* q2, const float* absmax2, const BlockLayout& layout,
                     const CodeLut& lut1, const CodeLut& lut2, const AdamWHyper& h,
                     float* scratch, float* amax1, float* amax2);
void adamw8bit_end(const float* scratch, const BlockLayout& layout, const CodeLut& lut1,
                   const CodeLut& lut2, const float* agreed1, const float* agreed2, uint8_t* q1,
                   float* absmax1, uint8_t* q2, float* absmax2);

// Muon's momentum as 8-bit block-wise codes, one fused pass per block: decode m
// (q, absmax), m <- lerp(m, g, 1 - beta), the update u = lerp(g, m, beta)
// (nesterov) or m, both in fp32 with torch.lerp's arithmetic; then m's new codes
// and scale into q_out, absmax_out (they may be q, absmax). Returns false if m
// holds NaN or Inf.
bool momentum8bit_step(const float* grad, const uint8_t* q, const float* absmax,
                       const BlockLayout& layout, const CodeLut& lut, float beta, bool nesterov,
                       uint8_t* q_out, float* absmax_out, float* u);

// The same entry points for the float8_e4m3fn format (formats/fp8_e4m3.h; the
// kernels: cpu/fp8.h), on the kernel set in use. AdamW's m is signed, its v
// keep_nonzero; scratch, amax and agreed as for the dynamic map.
bool quantize_fp8(const float* x, const BlockLayout& layout, bool keep_nonzero, uint8_t* q,
                  float* absmax);
void dequantize_fp8(const uint8_t* q, const float* absmax, const BlockLayout& layout, float* out);
void adamw_fp8_step(float* param, const float* grad, uint8_t* q1, float* absmax1, uint8_t* q2,
                    float* absmax2, const BlockLayout& layout, const AdamWHyper& h);
void adamw_fp8_begin(float* param, const float* grad, const uint8_t* q1, const float* absmax1,
                     const uint8_t* q2, const float* absmax2, const BlockLayout& layout,
                     const AdamWHyper& h, float* scratch, float* amax1, float* amax2);
void adamw_fp8_end(const float* scratch, const BlockLayout& layout, const float* agreed1,
                   const float* agreed2, uint8_t* q1, float* absmax1, uint8_t* q2,
                   float* absmax2);
bool momentum_fp8_step(const float* grad, const uint8_t* q, const float* absmax,
                       const BlockLayout& layout, float beta, bool nesterov, uint8_t* q_out,
                       float* absmax_out, float* u);

// One AdamW step with fp32 moments (the baseline), torch.optim.AdamW's formula.
void adamw32_step(float* param, const float* grad, float* m, float* v, int64_t n,
                  const AdamWHyper& h);

}  // namespace rfsdp::quant::cpu
