// The avx512 kernels of the float8_e4m3fn format (cpu/fp8.h): cpu/fp8_blocks.inc
// with 16 floats a vector, compiled for avx512f,avx512bw,avx512dq,avx512vl (F16C's
// conversion is AVX512F's at this width).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "quant/formats/absmax_bits.h"
#include "quant/formats/fp8_e4m3.h"
#include "quant/kernels/cpu/fp8.h"

// GCC only: the region below uses #pragma GCC target (clang takes the stub).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>

// Only the code below is compiled for avx512; the headers above keep the
// baseline target, so no inline function they define is emitted with it.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl")

namespace rfsdp::quant::cpu::avx512 {

namespace {
constexpr int kW = 16;
typedef float VF __attribute__((vector_size(4 * kW)));
typedef uint32_t VU __attribute__((vector_size(4 * kW)));
inline VF vsqrt(VF x) { return _mm512_sqrt_ps(x); }
// fp8_blocks.inc's decoding: 16 codes sign-extended to 16 bits, moved up 7 (sign to
// bit 15, e4m3's bit 14 of ones cleared), converted as fp16.
inline VF values_over_256(const uint8_t* q) {
  const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  const __m256i mask = _mm256_set1_epi16(static_cast<short>(0xBF80));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(w, 7), mask);
  return (VF)_mm512_cvtph_ps(h);
}
inline void store_codes(uint8_t* q, VU c) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8((__m512i)c));
}
// Packs leave 128-bit lane l's dwords as a, b, c, d's lane l: one permute puts
// each vector's four back together (dword 4k + l from 4l + k). The mask keeps a
// code's low byte as fp8_avx2.cpp's does (a NaN's code is above 255).
inline void store_codes4(uint8_t* q, VU a, VU b, VU c, VU d) {
  const __m512i low = _mm512_set1_epi16(0xFF);
  const __m512i ab = _mm512_and_si512(_mm512_packus_epi32((__m512i)a, (__m512i)b), low);
  const __m512i cd = _mm512_and_si512(_mm512_packus_epi32((__m512i)c, (__m512i)d), low);
  const __m512i bytes = _mm512_packus_epi16(ab, cd);
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_si512(q, _mm512_permutexvar_epi32(order, bytes));
}
#include "quant/kernels/cpu/fp8_blocks.inc"
}  // namespace

const Fp8Kernels& fp8_kernels() {
  static const Fp8Kernels k{quantize, dequantize, adamw, adamw_begin, adamw_end, momentum};
  return k;
}

}  // namespace rfsdp::quant::cpu::avx512

#pragma GCC pop_options

#else  // not x86-64 GCC: avx512::supported() is false, so this is never reached

#include <stdexcept>

namespace rfsdp::quant::cpu::avx512 {
const Fp8Kernels& fp8_kernels() {
  throw std::logic_error("the avx512 float8 kernels are not built for this compiler or CPU");
}
}  // namespace rfsdp::quant::cpu::avx512

#endif
