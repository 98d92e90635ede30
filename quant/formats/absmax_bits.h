// A block's max |x| as an unsigned max of magnitude bits, the vector kernels'
// rule (AVX2, AVX-512): |x|'s bits as unsigned integers order as the values do,
// and Inf and every NaN lie above all finite values, so one integer max finds
// the absmax and a non-finite value alike. Plain C++: the kernels' SIMD code
// takes the max, these the scalar ends; and the scale every CPU kernel set
// quantises a block with.
#pragma once

#include <cstdint>
#include <cstring>

namespace rfsdp::quant::cpu {

// |x|'s bits (the sign cleared).
inline uint32_t magnitude_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return bits & 0x7FFFFFFFu;
}

// The float whose magnitude bits are `bits` (a block's max); *bad set when it is
// Inf or NaN, the only bit patterns at or above Inf's.
inline float absmax_of_bits(uint32_t bits, bool* bad) {
  if (bits >= 0x7F800000u) *bad = true;
  float amax;
  std::memcpy(&amax, &bits, 4);
  return amax;
}

// The scale a block's values are multiplied by before their nearest codes: 1 /
// absmax, 0 for a block of zeros.
inline float scale_of(float amax) { return amax > 0.0f ? 1.0f / amax : 0.0f; }

}  // namespace rfsdp::quant::cpu
