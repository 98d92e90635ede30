// The arithmetic index of a code map: the nearest code of v computed with a
// few float and integer operations and one compare against a midpoint, with no
// table in memory. Plain C++ (host and device).
//
// The codes of the dynamic map are a sign, a decade and a linear position
// inside the decade (code_maps.h); the linear map is one such "level". For a
// value w, the binade of w and one compare against a decade boundary give the
// level l, and
//     f = trunc(w * a[l] - b[l])
// is the index of the code at or below w, up to float rounding where w is close
// to a code (never close to a midpoint). The nearest code is then f or f + 1,
// decided by w > mid[f] exactly as the binary search decides it.
//
// Maps that are symmetric about zero fold the sign: the index runs on |v| over
// the codes 127..254, and a negative v takes the mirror of that answer.
//
// Every step is written as the vector kernels do it (wrapping binade index,
// saturating packs), so nearest() here is bit for bit what they compute, and
// arithmetic_index() proves nearest() equal to the binary search on every float
// in (-2, 2) (quantisation only sees |v| <= 1 + 2^-22) before anyone uses it.
// Codes it cannot prove keep the table.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>

#include "quant/formats/block_layout.h"  // RFSDP_HOST_DEVICE

namespace rfsdp::quant {

// Midpoint i of a sorted 256-value code, the boundary between rounding to code i
// and to code i + 1 (ties go to i): (code[i] + code[i+1]) / 2 in float32, +inf
// for i = 255; with keep_nonzero (code[0] == 0: see CodeLut) mid 0 is 0, so a
// value above 0 never rounds to the code 0. Host and device compute it alike.
RFSDP_HOST_DEVICE inline float code_midpoint(const float* code, int i, bool keep_nonzero) {
  if (i >= 255) return INFINITY;
  if (i == 0 && keep_nonzero) return code[0];
  return (code[i] + code[i + 1]) * 0.5f;
}

struct CodeIndex {
  static constexpr uint32_t kLowestBinade = 96;  // float exponent field of binade 0 (2^-31)

  bool fold = false;  // symmetric map: index |v| over codes 127..254, mirror negatives
  float lo = 0.0f;    // without fold the index runs on max(v, lo), lo = the smallest code
  // Per binade (exponent field e >= kLowestBinade, binade e % 32; smaller e count as
  // kLowestBinade): a float whose low 4 bits hold the level below it; w at or above
  // it is one level up. A decade boundary (to a few ulps), or a NaN when the binade
  // holds none (compares false).
  uint32_t binade_key[32];
  // Per level: f = trunc(w * a - b); b includes the index of the level's first code.
  float a[16];
  float b[16];

  // The value the index runs on: |v| (sign bit cleared) or max(v, lo).
  RFSDP_HOST_DEVICE float index_value(float v) const {
    if (fold) return from_bits(bits(v) & 0x7FFFFFFFu);
    return v > lo ? v : lo;
  }
  // The candidate f for w = index_value(v): a fused multiply-subtract and a
  // truncation (NaN and overflow give INT32_MIN), as cvttps2dq does.
  RFSDP_HOST_DEVICE int32_t candidate(float w) const;
  // The nearest code of v, given the midpoints (mid[255] = +inf): what every
  // kernel computes, lane by lane. Ties go to the lower code, as in the search.
  RFSDP_HOST_DEVICE int32_t nearest(float v, const float* mid) const;
  // Which midpoint the candidate f is compared against (f already saturated to
  // 0..255): mid[f], or with fold the entry f & 127 of the folded table.
  RFSDP_HOST_DEVICE int32_t mid_slot(int32_t f) const {
    if (!fold) return f;
    return (f & 127) == 127 ? 127 : 128 + (f & 127);
  }
  // packus_epi32 then packus_epi16: int32 -> 0..65535 -> (as int16) 0..255.
  RFSDP_HOST_DEVICE static int32_t pack_saturate(int32_t x) {
    const int32_t w = x < 0 ? 0 : (x > 65535 ? 65535 : x);
    return w > 32767 ? 0 : (w > 255 ? 255 : w);
  }
  RFSDP_HOST_DEVICE static uint32_t bits(float f) {
    uint32_t b;
    __builtin_memcpy(&b, &f, 4);
    return b;
  }
  RFSDP_HOST_DEVICE static float from_bits(uint32_t b) {
    float f;
    __builtin_memcpy(&f, &b, 4);
    return f;
  }
};

// The index of `code` (256 sorted floats; mid[i] = (code[i] + code[i+1]) / 2 in
// float32, mid[255] = +inf), or nothing when neither the dynamic nor the linear
// structure fits it exactly.
std::optional<CodeIndex> arithmetic_index(const float* code, const float* mid);

// ---- inline ---------------------------------------------------------------

RFSDP_HOST_DEVICE inline int32_t CodeIndex::candidate(float w) const {
  uint32_t e = (bits(w) & 0x7FFFFFFFu) >> 23;
  e = (e < kLowestBinade ? kLowestBinade : e) & 31;
  const uint32_t key = binade_key[e];
  const int32_t level = static_cast<int32_t>(key & 15) + (w >= from_bits(key) ? 1 : 0);
#if defined(__CUDA_ARCH__)
  const float t = fmaf(w, a[level & 15], -b[level & 15]);
#else
  const float t = __builtin_fmaf(w, a[level & 15], -b[level & 15]);
#endif
  return (t > -2147483648.0f && t < 2147483648.0f) ? static_cast<int32_t>(t) : INT32_MIN;
}

RFSDP_HOST_DEVICE inline int32_t CodeIndex::nearest(float v, const float* mid) const {
  const float w = index_value(v);
  const int32_t f = candidate(w);
  float m = mid[mid_slot(pack_saturate(f))];
  const bool negative = fold && (bits(v) >> 31);
  // a negative v is nearest to 253 - f + [w < m] = 254 - (f + [w >= m]); w >= m is
  // w > (the float below m), m > 0 here
  if (negative) m = from_bits(bits(m) - 1);
  const int32_t r = f + (w > m ? 1 : 0);
  // (wrapping, as the vector lanes do)
  return pack_saturate(negative ? static_cast<int32_t>(254u - static_cast<uint32_t>(r)) : r);
}

}  // namespace rfsdp::quant
