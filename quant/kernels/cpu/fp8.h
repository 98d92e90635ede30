// The CPU kernels of the float8_e4m3fn state format (formats/fp8_e4m3.h), over
// blocks [b0, b1), one set per instruction set: portable (cpu/fp8_portable.cpp:
// scalar loops, the reference), AVX2 and AVX-512 (cpu/fp8_avx2.cpp,
// cpu/fp8_avx512.cpp: cpu/fp8_blocks.inc compiled for each). cpu/kernels.cpp
// picks the set and runs threads over blocks. All give the same bits: the same
// encode and decode steps, the AdamW and lerp arithmetic as adamw_update.h and
// torch.lerp write it, no FMA contraction. Contracts as cpu/kernels.h's entry
// points for the dynamic map; AdamW's m is signed, v keep_nonzero.
#pragma once

#include <cstdint>

#include "quant/formats/block_layout.h"
#include "quant/kernels/adamw_update.h"

namespace rfsdp::quant::cpu {

struct Fp8Kernels {
  // *bad turns true when x holds NaN or Inf.
  void (*quantize)(const float* x, const BlockLayout& L, bool keep_nonzero, uint8_t* q,
                   float* absmax, int64_t b0, int64_t b1, bool* bad);
  void (*dequantize)(const uint8_t* q, const float* absmax, const BlockLayout& L, float* out,
                     int64_t b0, int64_t b1);
  // mbuf, vbuf: 2 * L.max_block_elems() floats of scratch each (the vector sets
  // keep two blocks in flight: cpu/fp8_blocks.inc).
  void (*adamw)(float* p, const float* g, uint8_t* q1, float* absmax1, uint8_t* q2,
                float* absmax2, const BlockLayout& L, const AdamWCoeffs& c, int64_t b0,
                int64_t b1, float* mbuf, float* vbuf);
  void (*adamw_begin)(float* p, const float* g, const uint8_t* q1, const float* absmax1,
                      const uint8_t* q2, const float* absmax2, const BlockLayout& L,
                      const AdamWCoeffs& c, int64_t b0, int64_t b1, float* scratch, float* amax1,
                      float* amax2);
  void (*adamw_end)(const float* scratch, const BlockLayout& L, const float* agreed1,
                    const float* agreed2, uint8_t* q1, float* absmax1, uint8_t* q2,
                    float* absmax2, int64_t b0, int64_t b1);
  // Muon's momentum (cpu/kernels.h momentum8bit_step); mbuf: 2 * L.max_block_elems() floats.
  void (*momentum)(const float* g, const uint8_t* q, const float* absmax, const BlockLayout& L,
                   float beta, bool nesterov, uint8_t* q_out, float* absmax_out, float* u,
                   int64_t b0, int64_t b1, float* mbuf, bool* bad);
};

namespace portable { const Fp8Kernels& fp8_kernels(); }
namespace avx2 { const Fp8Kernels& fp8_kernels(); }      // only where avx2::supported()
namespace avx512 { const Fp8Kernels& fp8_kernels(); }    // only where avx512::supported()

}  // namespace rfsdp::quant::cpu
