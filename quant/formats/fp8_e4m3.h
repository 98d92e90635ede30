// The float8_e4m3fn state format: a code is the e4m3fn bit pattern (sign, 4
// exponent bits with bias 7, 3 mantissa bits; 448 the largest finite value,
// 2^-9 the smallest subnormal) of its value divided by its block's scale, with
// one fp32 absmax per block as the dynamic map keeps it. Encoded and decoded
// by integer and float arithmetic, no table, so a vector kernel spends a few
// ALU operations where the dynamic map spends shuffles. Plain C++, host and
// device: the scalar form every kernel set (cpu portable and the vector tails,
// CUDA) computes; the vector sets (cpu/fp8_blocks.inc) give the same bits, with
// a few steps written another way (decoding by the CPU's fp16 conversion).
//
// Per block (absmax a):
//   encode  code = e4m3(x * (448 / a)), rounded to nearest even exactly as
//           torch's cast x.to(torch.float8_e4m3fn) (c10's fp8e4m3fn_from_fp32);
//   decode  x'   = e4m3_value(code) * (a / 448).
// keep_nonzero (Adam's second moment, v >= 0): a value above 0 never takes the
// code 0; where the cast rounds it to 0 (below 2^-10 a / 448) it takes code 1
// (2^-9 a / 448), as the dynamic map's keep_nonzero midpoints do. A v stored as 0
// beside a non-zero m turns m / (sqrt(v) + eps) into m / eps; one rounded up to
// the smallest code only makes that element's step smaller. v shares m's scale
// (a / 448): e4m3 is a float, so it keeps 3 mantissa bits over the 17.8 binades
// below the block's max, and what falls under that floor keeps code 1.
#pragma once

#include <cfloat>
#include <cstdint>
#include <cstring>

#include "quant/formats/block_layout.h"  // RFSDP_HOST_DEVICE

namespace rfsdp::quant::fp8 {

constexpr float kMax = 448.0f;

RFSDP_HOST_DEVICE inline uint32_t bits_of(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
#endif
}
RFSDP_HOST_DEVICE inline float float_of(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float x;
  std::memcpy(&x, &b, 4);
  return x;
#endif
}

// The factor a block's values are multiplied by before their codes: 448 / a
// (0 for a block of zeros). Held below +inf (a below 448 / FLT_MAX) so that a
// zero times it stays 0.
RFSDP_HOST_DEVICE inline float encode_scale(float amax) {
  if (!(amax > 0.0f)) return 0.0f;
  const float r = kMax / amax;
  return r < FLT_MAX ? r : FLT_MAX;
}
// The factor a block's code values are multiplied by: a / 448.
RFSDP_HOST_DEVICE inline float decode_scale(float amax) { return amax / kMax; }

// Constants of the encoding (c10's): below 2^-6 (exponent field 121) a value
// is an e4m3 subnormal, rounded by adding 2^14, whose ulp is 2^-9; above, the
// mantissa is rounded to 3 bits by adding 0x7FFFF plus the kept bit's parity,
// and the exponent rebiased from 127 to 7.
constexpr uint32_t kSubnormalBelow = 121u << 23;
constexpr uint32_t kDenormMagic = 141u << 23;  // 2^14
constexpr uint32_t kRebiasRound = 0xC407FFFFu;  // ((7 - 127) << 23) + 0x7FFFF, mod 2^32

// The e4m3fn code of y, for finite |y| < 464 (above, the cast gives NaN; the
// kernels never pass one: |x| <= a makes |y| <= 448 within an ulp).
RFSDP_HOST_DEVICE inline uint8_t encode(float y, bool keep_nonzero) {
  const uint32_t b = bits_of(y);
  const uint32_t sign = b & 0x80000000u;
  const uint32_t a = b ^ sign;
  uint32_t r;
  if (a < kSubnormalBelow) {
    r = bits_of(float_of(a) + float_of(kDenormMagic)) - kDenormMagic;
  } else {
    r = (a + kRebiasRound + ((a >> 20) & 1u)) >> 20;
  }
  r |= sign >> 24;
  if (keep_nonzero && r == 0u && y > 0.0f) r = 1u;
  return static_cast<uint8_t>(r);
}

// The value of code q (never 0x7F or 0xFF, e4m3fn's NaNs: encode makes none).
// Exponent field 0: the subnormal m * 2^-9, exactly by an int-to-float
// conversion; else the fp32 with the exponent rebiased (+120) and the mantissa
// moved up 20 bits.
RFSDP_HOST_DEVICE inline float decode(uint8_t q) {
  const uint32_t em = q & 0x7Fu;
  const uint32_t mag = em < 8u ? bits_of(static_cast<float>(static_cast<int32_t>(em)) * 0.001953125f)
                               : (em << 20) + (120u << 23);
  return float_of(mag | (static_cast<uint32_t>(q & 0x80u) << 24));
}

}  // namespace rfsdp::quant::fp8
