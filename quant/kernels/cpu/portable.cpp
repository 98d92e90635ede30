#include "quant/kernels/cpu/portable.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

#include "quant/formats/absmax_bits.h"

// Hot loops get an AVX2 clone and a baseline one; the loader picks (GCC ifunc).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RFSDP_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define RFSDP_CLONES
#endif

namespace rfsdp::quant::cpu::portable {

// Nearest codes of n values x[i] * scale: table slot, table entry, one
// midpoint compare. A vectorisable pass computes the slots, a scalar pass does
// the two table loads, the compare and the byte store. (An AVX2 version with
// gathers measured no faster on this project's AMD EPYC machines.)
inline void nearest_codes_portable(const float* __restrict x, float scale, int64_t n,
                            const uint8_t* __restrict table, const float* __restrict slot_mid,
                            uint8_t* __restrict q) {
  constexpr int64_t C = 256;
  float v[C];
  uint32_t k[C];
  for (int64_t base = 0; base < n; base += C) {
    const int64_t len = n - base < C ? n - base : C;
    for (int64_t j = 0; j < len; ++j) {
      v[j] = x[base + j] * scale;
      k[j] = CodeLut::key(v[j]);
    }
    for (int64_t j = 0; j < len; ++j) {
      q[base + j] = static_cast<uint8_t>(table[k[j]] + (v[j] > slot_mid[k[j]] ? 1u : 0u));
    }
  }
}

RFSDP_CLONES
void nearest_codes_by_table(const float* __restrict x, float scale, int64_t n,
                            const uint8_t* __restrict table, const float* __restrict slot_mid,
                            uint8_t* __restrict q) {
  nearest_codes_portable(x, scale, n, table, slot_mid, q);
}

// The table where it is exact for this code, else the binary search.
void nearest_codes(const float* x, float scale, int64_t n, const CodeLut& lut, uint8_t* q) {
  if (lut.table_exact()) return nearest_codes_by_table(x, scale, n, lut.table(), lut.slot_mid(), q);
  for (int64_t i = 0; i < n; ++i) q[i] = lut.nearest_by_search(x[i] * scale);
}

// Max |x| over a block; *bad turns non-zero on NaN or Inf (x * 0 is then
// NaN). Independent lanes let the compiler vectorise without reassociating.
RFSDP_CLONES
float block_absmax(const float* __restrict x, const BlockLayout::Block& blk, int64_t row_len,
                   float* bad) {
  constexpr int W = 16;
  float am[W] = {0}, pr[W] = {0};
  for (int64_t s = 0; s < blk.segments; ++s) {
    const float* __restrict p = x + blk.start + s * row_len;
    int64_t i = 0;
    for (; i + W <= blk.seg_len; i += W) {
      for (int j = 0; j < W; ++j) {
        const float a = std::fabs(p[i + j]);
        am[j] = am[j] < a ? a : am[j];
        pr[j] += p[i + j] * 0.0f;
      }
    }
    for (; i < blk.seg_len; ++i) {
      const float a = std::fabs(p[i]);
      am[0] = am[0] < a ? a : am[0];
      pr[0] += p[i] * 0.0f;
    }
  }
  float amax = 0.0f, probe = 0.0f;
  for (int j = 0; j < W; ++j) {
    amax = amax < am[j] ? am[j] : amax;
    probe += pr[j];
  }
  *bad = probe;
  return amax;
}

RFSDP_CLONES
void quantize_blocks(const float* __restrict x, const BlockLayout& L, const CodeLut& lut,
                     uint8_t* __restrict q, float* __restrict absmax, int64_t b0, int64_t b1,
                     std::atomic<bool>* bad_any) {
  for (int64_t b = b0; b < b1; ++b) {
    const auto blk = L.block(b);
    float bad;
    const float amax = block_absmax(x, blk, L.row_len, &bad);
    if (bad != 0.0f || std::isnan(bad)) bad_any->store(true, std::memory_order_relaxed);
    const float scale = scale_of(amax);
    for (int64_t s = 0; s < blk.segments; ++s) {
      const int64_t off = blk.start + s * L.row_len;
      nearest_codes(x + off, scale, blk.seg_len, lut, q + off);
    }
    absmax[b] = amax;
  }
}

RFSDP_CLONES
void dequantize_blocks(const uint8_t* __restrict q, const float* __restrict absmax,
                       const BlockLayout& L, const float* __restrict code, float* __restrict out,
                       int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const auto blk = L.block(b);
    const float a = absmax[b];
    for (int64_t s = 0; s < blk.segments; ++s) {
      const int64_t off = blk.start + s * L.row_len;
      for (int64_t i = 0; i < blk.seg_len; ++i) out[off + i] = code[q[off + i]] * a;
    }
  }
}

// torch.lerp's float arithmetic: a + w (b - a) for |w| < 0.5, else b - (b - a)(1 - w).
inline float torch_lerp(float a, float b, float w) {
  return std::fabs(w) < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w);
}

// One run of a momentum block: decoded, updated (mbuf), the update written.
RFSDP_CLONES
void momentum8bit_run(const float* __restrict g, const uint8_t* __restrict q,
                      const float* __restrict code, float a, float beta, bool nesterov,
                      int64_t n, float* __restrict m, float* __restrict u) {
  const float w = 1.0f - beta;
  for (int64_t i = 0; i < n; ++i) m[i] = torch_lerp(code[q[i]] * a, g[i], w);
  if (nesterov) {
    for (int64_t i = 0; i < n; ++i) u[i] = torch_lerp(g[i], m[i], beta);
  } else {
    for (int64_t i = 0; i < n; ++i) u[i] = m[i];
  }
}

void momentum8bit_blocks(const float* g, const uint8_t* q, const float* absmax, const BlockLayout& L,
                         const CodeLut& lut, float beta, bool nesterov, uint8_t* q_out,
                         float* absmax_out, float* u, int64_t b0, int64_t b1, float* mbuf,
                         std::atomic<bool>* bad_any) {
  for (int64_t b = b0; b < b1; ++b) {
    const auto blk = L.block(b);
    const float a = absmax[b];
    for (int64_t s = 0; s < blk.segments; ++s) {  // the block's m, packed in mbuf
      const int64_t off = blk.start + s * L.row_len;
      momentum8bit_run(g + off, q + off, lut.code(), a, beta, nesterov, blk.seg_len,
                       mbuf + s * blk.seg_len, u + off);
    }
    float bad;
    const BlockLayout::Block packed{0, 1, blk.count, blk.count};
    const float amax = block_absmax(mbuf, packed, blk.count, &bad);
    if (bad != 0.0f || std::isnan(bad)) bad_any->store(true, std::memory_order_relaxed);
    const float scale = scale_of(amax);
    for (int64_t s = 0; s < blk.segments; ++s) {
      nearest_codes(mbuf + s * blk.seg_len, scale, blk.seg_len, lut, q_out + blk.start + s * L.row_len);
    }
    absmax_out[b] = amax;
  }
}

// The fp32 update of one contiguous run: moments in m/v (dequantised on entry,
// updated on exit), parameter in place. Simple loops, so each vectorises.
RFSDP_CLONES
void adamw8bit_run(float* __restrict p, const float* __restrict g, const uint8_t* __restrict q1,
                   const uint8_t* __restrict q2, float a1, float a2, const float* __restrict code1,
                   const float* __restrict code2, const AdamWCoeffs& c, int64_t n,
                   float* __restrict m, float* __restrict v) {
  for (int64_t i = 0; i < n; ++i) {
    m[i] = code1[q1[i]] * a1;
    v[i] = code2[q2[i]] * a2;
  }
  for (int64_t i = 0; i < n; ++i) adamw_update(p[i], m[i], v[i], g[i], c);
}

// Max of |x| over n values, in independent lanes (vectorises without reassociation).
RFSDP_CLONES
float max_abs(const float* __restrict x, int64_t n) {
  constexpr int W = 16;
  float am[W] = {0};
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    for (int j = 0; j < W; ++j) {
      const float a = std::fabs(x[i + j]);
      am[j] = am[j] < a ? a : am[j];
    }
  }
  for (; i < n; ++i) am[0] = am[0] < std::fabs(x[i]) ? std::fabs(x[i]) : am[0];
  float r = 0.0f;
  for (int j = 0; j < W; ++j) r = r < am[j] ? am[j] : r;
  return r;
}

namespace {

// The first half of one block's step: decode, update the parameter and the
// moments (into mbuf, vbuf: the block's elements segment after segment); the
// new moments' max |.| into *amax1, *amax2.
void update_block(float* __restrict p, const float* __restrict g, const uint8_t* __restrict q1,
                  const uint8_t* __restrict q2, float a1, float a2, const BlockLayout& L,
                  const BlockLayout::Block& blk, const CodeLut& lut1, const CodeLut& lut2,
                  const AdamWCoeffs& c, float* __restrict mbuf, float* __restrict vbuf,
                  float* amax1, float* amax2) {
  for (int64_t s = 0; s < blk.segments; ++s) {
    const int64_t off = blk.start + s * L.row_len, k = s * blk.seg_len;
    adamw8bit_run(p + off, g + off, q1 + off, q2 + off, a1, a2, lut1.code(), lut2.code(), c,
                  blk.seg_len, mbuf + k, vbuf + k);
  }
  *amax1 = max_abs(mbuf, blk.count);
  *amax2 = max_abs(vbuf, blk.count);
}

// The second half: the block's codes of mbuf, vbuf under absmax a1, a2.
void encode_block(const float* mbuf, const float* vbuf, const BlockLayout& L,
                  const BlockLayout::Block& blk, const CodeLut& lut1, const CodeLut& lut2,
                  float a1, float a2, uint8_t* __restrict q1, uint8_t* __restrict q2) {
  const float s1 = scale_of(a1), s2 = scale_of(a2);
  for (int64_t s = 0; s < blk.segments; ++s) {
    const int64_t off = blk.start + s * L.row_len, k = s * blk.seg_len;
    nearest_codes(mbuf + k, s1, blk.seg_len, lut1, q1 + off);
    nearest_codes(vbuf + k, s2, blk.seg_len, lut2, q2 + off);
  }
}

}  // namespace

void adamw8bit_blocks(float* __restrict p, const float* __restrict g, uint8_t* __restrict q1,
                      float* __restrict absmax1, uint8_t* __restrict q2, float* __restrict absmax2,
                      const BlockLayout& L, const CodeLut& lut1, const CodeLut& lut2,
                      const AdamWCoeffs& c, int64_t b0, int64_t b1, float* __restrict mbuf,
                      float* __restrict vbuf) {
  for (int64_t b = b0; b < b1; ++b) {
    const auto blk = L.block(b);
    float amax1, amax2;
    update_block(p, g, q1, q2, absmax1[b], absmax2[b], L, blk, lut1, lut2, c, mbuf, vbuf, &amax1,
                 &amax2);
    encode_block(mbuf, vbuf, L, blk, lut1, lut2, amax1, amax2, q1, q2);
    absmax1[b] = amax1;
    absmax2[b] = amax2;
  }
}

void adamw8bit_begin_blocks(float* p, const float* g, const uint8_t* q1, const float* absmax1,
                            const uint8_t* q2, const float* absmax2, const BlockLayout& L,
                            const CodeLut& lut1, const CodeLut& lut2, const AdamWCoeffs& c,
                            int64_t b0, int64_t b1, float* scratch, float* amax1, float* amax2) {
  const int64_t w = L.max_block_elems();
  for (int64_t b = b0; b < b1; ++b) {
    update_block(p, g, q1, q2, absmax1[b], absmax2[b], L, L.block(b), lut1, lut2, c,
                 scratch + 2 * b * w, scratch + (2 * b + 1) * w, amax1 + b, amax2 + b);
  }
}

void adamw8bit_end_blocks(const float* scratch, const BlockLayout& L, const CodeLut& lut1,
                          const CodeLut& lut2, const float* agreed1, const float* agreed2,
                          uint8_t* q1, float* absmax1, uint8_t* q2, float* absmax2, int64_t b0,
                          int64_t b1) {
  const int64_t w = L.max_block_elems();
  for (int64_t b = b0; b < b1; ++b) {
    encode_block(scratch + 2 * b * w, scratch + (2 * b + 1) * w, L, L.block(b), lut1, lut2,
                 agreed1[b], agreed2[b], q1, q2);
    absmax1[b] = agreed1[b];
    absmax2[b] = agreed2[b];
  }
}

RFSDP_CLONES
void adamw32_range(float* __restrict p, const float* __restrict g, float* __restrict m,
                   float* __restrict v, const AdamWCoeffs& c, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) adamw_update(p[i], m[i], v[i], g[i], c);
}

}  // namespace rfsdp::quant::cpu::portable
