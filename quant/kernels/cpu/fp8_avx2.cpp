// The avx2 kernels of the float8_e4m3fn format (cpu/fp8.h): cpu/fp8_blocks.inc
// with 8 floats a vector, compiled for avx2,fma,f16c.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "quant/formats/absmax_bits.h"
#include "quant/formats/fp8_e4m3.h"
#include "quant/kernels/cpu/fp8.h"

// GCC only: the region below uses #pragma GCC target (clang takes the stub).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>

// Only the code below is compiled for avx2; the headers above keep the
// baseline target, so no inline function they define is emitted with it.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace rfsdp::quant::cpu::avx2 {

namespace {
constexpr int kW = 8;
typedef float VF __attribute__((vector_size(4 * kW)));
typedef uint32_t VU __attribute__((vector_size(4 * kW)));
inline VF vsqrt(VF x) { return _mm256_sqrt_ps(x); }
// fp8_blocks.inc's decoding: 8 codes sign-extended to 16 bits, moved up 7 (sign to
// bit 15, e4m3's bit 14 of ones cleared), converted as fp16 (F16C).
inline VF values_over_256(const uint8_t* q) {
  const __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  const __m128i h = _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(static_cast<short>(0xBF80)));
  return (VF)_mm256_cvtph_ps(h);
}
// Each 128-bit lane's four low bytes to its bottom (vpshufb), the two lanes' words side by side.
inline void store_codes(uint8_t* q, VU c) {
  const __m256i low = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                       0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i t = _mm256_shuffle_epi8((__m256i)c, low);
  const uint64_t v = static_cast<uint32_t>(_mm256_cvtsi256_si32(t)) |
                     static_cast<uint64_t>(static_cast<uint32_t>(_mm256_extract_epi32(t, 4))) << 32;
  std::memcpy(q, &v, 8);
}
// Packs leave each 128-bit lane's dwords as a, b, c, d (lane 0's, then lane 1's): one
// permute puts each vector's two back together. A code lane is below 2^16 (a NaN's
// up to 0x4BC): the first pack keeps it, the mask keeps its low byte as the scalar
// cast does (the second pack would saturate it).
inline void store_codes4(uint8_t* q, VU a, VU b, VU c, VU d) {
  const __m256i low = _mm256_set1_epi16(0xFF);
  const __m256i ab = _mm256_and_si256(_mm256_packus_epi32((__m256i)a, (__m256i)b), low);
  const __m256i cd = _mm256_and_si256(_mm256_packus_epi32((__m256i)c, (__m256i)d), low);
  const __m256i bytes = _mm256_packus_epi16(ab, cd);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, order));
}
#include "quant/kernels/cpu/fp8_blocks.inc"
}  // namespace

const Fp8Kernels& fp8_kernels() {
  static const Fp8Kernels k{quantize, dequantize, adamw, adamw_begin, adamw_end, momentum};
  return k;
}

}  // namespace rfsdp::quant::cpu::avx2

#pragma GCC pop_options

#else  // not x86-64 GCC: avx2::supported() is false, so this is never reached

#include <stdexcept>

namespace rfsdp::quant::cpu::avx2 {
const Fp8Kernels& fp8_kernels() {
  throw std::logic_error("the avx2 float8 kernels are not built for this compiler or CPU");
}
}  // namespace rfsdp::quant::cpu::avx2

#endif
