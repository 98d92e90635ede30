#include "quant/ops/absmax_codes.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <stdexcept>

namespace rfsdp::quant::cpu {

namespace {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// c10's fp8e4m3fn_from_fp32_value for |q| <= 448 (the caller clamps), without
// branches (both roundings computed, one kept): vectorisable.
inline uint8_t e4m3fn_of(float q) {
  uint32_t u = bits_of(q);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  constexpr uint32_t denorm_mask = ((127 - 7) + (23 - 3) + 1) << 23;
  // below 2^-6: the sum's low bits are the subnormal code (nearest even by the add)
  const uint8_t sub = static_cast<uint8_t>(bits_of(float_of(u) + float_of(denorm_mask)) - denorm_mask);
  const uint32_t mant_odd = (u >> 20) & 1;
  const uint8_t norm = static_cast<uint8_t>((u + (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFF + mant_odd) >> 20);
  return static_cast<uint8_t>((u < (121u << 23) ? sub : norm) | (sign >> 24));
}

// float -> bfloat16, nearest even (finite inputs; NaN as c10 makes it).
inline uint16_t bf16_of(float f) {
  if (std::isnan(f)) return c10::BFloat16(f).x;
  const uint32_t u = bits_of(f);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}

const std::array<float, 256>& e4m3fn_values() {
  static const std::array<float, 256> t = [] {
    std::array<float, 256> v{};
    for (int c = 0; c < 256; ++c) v[c] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(c), c10::Float8_e4m3fn::from_bits()));
    return v;
  }();
  return t;
}

constexpr int64_t kGrainElems = int64_t{1} << 16;

// The loops, built for AVX-512, AVX2 and the baseline (chosen at load time by
// the CPU; every clone does the same IEEE operations, no FMA: the same bits).
#define RFSDP_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

// Selects the compilers turn into vector max / blends without -ffast-math (std::max
// and std::min are not, for their NaN and signed-zero rules).
inline float max_of(float a, float b) { return a > b ? a : b; }
inline float clamp_of(float q, float hi) {
  q = q < -hi ? -hi : q;
  return q > hi ? hi : q;
}

RFSDP_CLONES float absmax_of(const float* x, int64_t len) {
  float m[16] = {0};  // lanes: a max of maxes, in any order, is exact
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    for (int k = 0; k < 16; ++k) m[k] = max_of(std::fabs(x[i + k]), m[k]);
  }
  for (; i < len; ++i) m[0] = max_of(std::fabs(x[i]), m[0]);
  float r = 0.0f;
  for (int k = 0; k < 16; ++k) r = max_of(m[k], r);
  return r;
}

RFSDP_CLONES void int8_codes(const float* x, int64_t len, float den, uint8_t* c) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: (q + it) - it rounds half to even
  for (int64_t i = 0; i < len; ++i) {
    // (integral bounds: clamping and rounding commute)
    const float q = clamp_of(x[i] / den, 127.0f);
    c[i] = static_cast<uint8_t>(static_cast<int8_t>(static_cast<int32_t>((q + kRound) - kRound)));
  }
}

RFSDP_CLONES void e4m3fn_codes(const float* x, int64_t len, float den, uint8_t* c) {
  for (int64_t i = 0; i < len; ++i) c[i] = e4m3fn_of(clamp_of(x[i] / den, 448.0f));
}

RFSDP_CLONES void int8_values(const uint8_t* c, int64_t len, float s, float* out) {
  for (int64_t i = 0; i < len; ++i) out[i] = static_cast<float>(static_cast<int8_t>(c[i])) * s;
}

RFSDP_CLONES void bf16_values(const float* v, int64_t len, uint16_t* out) {
  for (int64_t i = 0; i < len; ++i) {
    const uint32_t u = bits_of(v[i]);
    out[i] = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
  }
}

}  // namespace

void absmax_encode(const float* x, int64_t n, int64_t block, AbsmaxCode kind, uint8_t* codes,
                   float* scales) {
  const int64_t nb = (n + block - 1) / block;
  const float code_max = kind == AbsmaxCode::kInt8 ? 127.0f : 448.0f;
  at::parallel_for(0, nb, std::max<int64_t>(1, kGrainElems / block), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* xb = x + b * block;
      const int64_t len = std::min(block, n - b * block);
      const float scale = absmax_of(xb, len) / code_max;
      scales[b] = scale;
      const float den = scale == 0.0f ? 1.0f : scale;  // (a block of zeros: codes 0)
      if (kind == AbsmaxCode::kInt8) {
        int8_codes(xb, len, den, codes + b * block);
      } else {
        e4m3fn_codes(xb, len, den, codes + b * block);
      }
    }
  });
}

void absmax_decode(const uint8_t* codes, const float* scales, int64_t n, int64_t block,
                   AbsmaxCode kind, at::ScalarType out_dtype, void* out) {
  if (out_dtype != at::kFloat && out_dtype != at::kBFloat16 && out_dtype != at::kHalf) {
    throw std::invalid_argument("absmax_decode: the output must be float32, bfloat16 or float16");
  }
  const int64_t nb = (n + block - 1) / block;
  const float* lut = e4m3fn_values().data();
  at::parallel_for(0, nb, std::max<int64_t>(1, kGrainElems / block), [&](int64_t b0, int64_t b1) {
    float tmp[256];
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* cb = codes + b * block;
      const int64_t len = std::min(block, n - b * block);
      const float s = scales[b];
      for (int64_t i0 = 0; i0 < len; i0 += 256) {  // fp32 values a chunk at a time, then the cast
        const int64_t m = std::min<int64_t>(256, len - i0);
        if (kind == AbsmaxCode::kInt8) {
          int8_values(cb + i0, m, s, tmp);
        } else {
          for (int64_t i = 0; i < m; ++i) tmp[i] = lut[cb[i0 + i]] * s;
        }
        const int64_t at = b * block + i0;
        if (out_dtype == at::kFloat) {
          std::memcpy(static_cast<float*>(out) + at, tmp, m * 4);
        } else if (out_dtype == at::kBFloat16) {
          uint16_t* o = static_cast<uint16_t*>(out) + at;
          bool nan = false;
          for (int64_t i = 0; i < m; ++i) nan |= std::isnan(tmp[i]);
          if (nan) {
            for (int64_t i = 0; i < m; ++i) o[i] = bf16_of(tmp[i]);
          } else {
            bf16_values(tmp, m, o);
          }
        } else {
          c10::Half* o = static_cast<c10::Half*>(out) + at;
          for (int64_t i = 0; i < m; ++i) o[i] = c10::Half(tmp[i]);
        }
      }
    }
  });
}

}  // namespace rfsdp::quant::cpu
