#include "quant/kernels/cpu/avx2.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "quant/formats/absmax_bits.h"

// GCC only: the AVX2 region below uses #pragma GCC target (clang takes the stubs).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>

// Only the code below is compiled for AVX2 and FMA; the headers above keep the
// baseline target, so no inline function they define is emitted with it.
#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace rfsdp::quant::cpu::avx2 {

namespace {

// CodeIndex in registers: its 32 binade keys and 16 levels' coefficients (looked
// up with vpermd and blends), its midpoints (gathered).
struct IndexRegs {
  __m256i key[4];
  __m256 a[2], b[2];
  __m256 lo;
  bool fold;
  const float* mid;
  const CodeIndex* ix;
  // Where the lookup table is exact (the dynamic maps): its slot entries (one
  // gather a lane) in place of the index (fewer instructions a lane).
  const int32_t* entry;
  explicit IndexRegs(const CodeLut& lut)
      : fold(lut.index()->fold), mid(lut.mid()), ix(lut.index()),
        entry(lut.table_exact() ? lut.entry_by_top16() : nullptr) {
    for (int k = 0; k < 4; ++k) key[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ix->binade_key + 8 * k));
    for (int k = 0; k < 2; ++k) a[k] = _mm256_loadu_ps(ix->a + 8 * k), b[k] = _mm256_loadu_ps(ix->b + 8 * k);
    lo = _mm256_set1_ps(ix->lo);
  }
};

inline __m256i bit_set(__m256i x, int bit) {  // all-ones lanes where x has `bit`
  const __m256i m = _mm256_set1_epi32(bit);
  return _mm256_cmpeq_epi32(_mm256_and_si256(x, m), m);
}

// CodeIndex::pack_saturate lane-wise.
inline __m256i pack_saturate(__m256i x) {
  const __m256i s = _mm256_min_epi32(_mm256_max_epi32(x, _mm256_setzero_si256()), _mm256_set1_epi32(65535));
  return _mm256_blendv_epi8(_mm256_min_epi32(s, _mm256_set1_epi32(255)), _mm256_setzero_si256(),
                            _mm256_cmpgt_epi32(s, _mm256_set1_epi32(32767)));
}

// CodeIndex::nearest(v, mid) for 8 lanes (Fold: r.fold).
template <bool Fold>
inline __m256i nearest8(__m256 v, const IndexRegs& r) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256 w = Fold ? _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(v), abs_mask))
                          : _mm256_max_ps(v, r.lo);
  // candidate: the binade's key, the level, trunc(w * a - b)
  __m256i e = _mm256_srli_epi32(_mm256_and_si256(_mm256_castps_si256(w), abs_mask), 23);
  e = _mm256_and_si256(_mm256_max_epu32(e, _mm256_set1_epi32(CodeIndex::kLowestBinade)),
                       _mm256_set1_epi32(31));
  const __m256i k01 = _mm256_blendv_epi8(_mm256_permutevar8x32_epi32(r.key[0], e),
                                         _mm256_permutevar8x32_epi32(r.key[1], e), bit_set(e, 8));
  const __m256i k23 = _mm256_blendv_epi8(_mm256_permutevar8x32_epi32(r.key[2], e),
                                         _mm256_permutevar8x32_epi32(r.key[3], e), bit_set(e, 8));
  const __m256i key = _mm256_blendv_epi8(k01, k23, bit_set(e, 16));
  __m256i lvl = _mm256_and_si256(key, _mm256_set1_epi32(15));
  lvl = _mm256_sub_epi32(lvl, _mm256_castps_si256(_mm256_cmp_ps(w, _mm256_castsi256_ps(key), _CMP_GE_OQ)));
  const __m256 up = _mm256_castsi256_ps(bit_set(lvl, 8));
  const __m256 a = _mm256_blendv_ps(_mm256_permutevar8x32_ps(r.a[0], lvl), _mm256_permutevar8x32_ps(r.a[1], lvl), up);
  const __m256 b = _mm256_blendv_ps(_mm256_permutevar8x32_ps(r.b[0], lvl), _mm256_permutevar8x32_ps(r.b[1], lvl), up);
  const __m256i f = _mm256_cvttps_epi32(_mm256_fmsub_ps(w, a, b));  // out of range: INT32_MIN
  __m256i slot = pack_saturate(f);
  if (Fold) {  // mid_slot: f & 127, or 128 + (f & 127)
    const __m256i f7 = _mm256_and_si256(slot, _mm256_set1_epi32(127));
    slot = _mm256_blendv_epi8(_mm256_add_epi32(f7, _mm256_set1_epi32(128)), f7,
                              _mm256_cmpeq_epi32(f7, _mm256_set1_epi32(127)));
  }
  __m256i m = _mm256_castps_si256(_mm256_i32gather_ps(r.mid, slot, 4));
  const __m256i negative = Fold ? _mm256_srai_epi32(_mm256_castps_si256(v), 31) : _mm256_setzero_si256();
  m = _mm256_add_epi32(m, negative);  // a negative v compares against the float below m
  const __m256i n = _mm256_sub_epi32(f, _mm256_castps_si256(_mm256_cmp_ps(w, _mm256_castsi256_ps(m), _CMP_GT_OQ)));
  return pack_saturate(_mm256_blendv_epi8(n, _mm256_sub_epi32(_mm256_set1_epi32(254), n), negative));
}

// CodeLut::nearest for 8 lanes: one gather of the slot entry by the value's top 16
// bits (its code index and truncated midpoint: CodeLut::entry_by_top16), one
// compare; the exact midpoint is gathered only for lanes within 255 ulps of it.
inline __m256i nearest8_table(__m256 v, const int32_t* entry, const float* mid) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i e = _mm256_i32gather_epi32(entry, _mm256_srli_epi32(bits, 16), 4);
  const __m256i t = _mm256_and_si256(e, _mm256_set1_epi32(0xFF));
  __m256 m = _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_set1_epi32(0xFF), e));
  const __m256i near = _mm256_cmpeq_epi32(_mm256_srli_epi32(_mm256_xor_si256(bits, e), 8),
                                          _mm256_setzero_si256());
  if (!_mm256_testz_si256(near, near)) m = _mm256_mask_i32gather_ps(m, mid, t, _mm256_castsi256_ps(near), 4);
  return _mm256_sub_epi32(t, _mm256_castps_si256(_mm256_cmp_ps(v, m, _CMP_GT_OQ)));
}

inline void store8_codes(uint8_t* q, __m256i c) {  // 8 lanes of 0..255 -> 8 bytes
  const __m256i w = _mm256_packus_epi16(_mm256_packus_epi32(c, c), _mm256_setzero_si256());
  const uint32_t lo = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_castsi256_si128(w)));
  const uint32_t hi = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_extracti128_si256(w, 1)));
  const uint64_t both = lo | (static_cast<uint64_t>(hi) << 32);
  std::memcpy(q, &both, 8);
}

inline __m256 decode8(const uint8_t* q, const float* code) {
  return _mm256_i32gather_ps(code, _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))), 4);
}

inline __m256 abs8(__m256 x) { return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }

inline float hmax(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// Codes of x[i] * scale, n values. (The index copied here stays in registers:
// the byte stores may alias the caller's copy.)
template <bool Fold>
void encode_run_as(const float* x, float scale, int64_t n, const IndexRegs& regs, uint8_t* q) {
  const IndexRegs r = regs;
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8_codes(q + i, nearest8<Fold>(_mm256_mul_ps(_mm256_loadu_ps(x + i), s), r));
  for (; i < n; ++i) q[i] = static_cast<uint8_t>(r.ix->nearest(x[i] * scale, r.mid));
}
// Codes of 32 values x[i] * s by the table (r.entry), four lanes of 8 -> 32 bytes;
// x[ahead] fetched meanwhile (0: none).
__attribute__((always_inline)) inline void encode32_table(const float* x, __m256 s, const IndexRegs& r,
                                                          uint8_t* q, int64_t ahead) {
  if (ahead) {
    _mm_prefetch(reinterpret_cast<const char*>(x + ahead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(x + ahead + 16), _MM_HINT_T0);
  }
  __m256i c[4];
  for (int j = 0; j < 4; ++j) {
    c[j] = nearest8_table(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), s), r.entry, r.mid);
  }
  const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// ahead: prefetch x[i + ahead] as x[i] is encoded (0: none).
__attribute__((always_inline)) inline void encode_run(const float* x, float scale, int64_t n,
                                                   const IndexRegs& r, uint8_t* q,
                                                   int64_t ahead = 0) {
  if (r.entry) {
    const __m256 s = _mm256_set1_ps(scale);
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) encode32_table(x + i, s, r, q + i, ahead);
    for (; i + 8 <= n; i += 8) {
      store8_codes(q + i, nearest8_table(_mm256_mul_ps(_mm256_loadu_ps(x + i), s), r.entry, r.mid));
    }
    for (; i < n; ++i) q[i] = static_cast<uint8_t>(r.ix->nearest(x[i] * scale, r.mid));
    return;
  }
  if (r.fold) return encode_run_as<true>(x, scale, n, r, q);
  encode_run_as<false>(x, scale, n, r, q);
}

// How far the kernels prefetch along a long row: a block or more ahead (4 KiB of
// floats), as the AVX-512 kernels; along a tile's row, two tiles.
constexpr int64_t kRowAhead = 1024;
inline int64_t prefetch_distance(const BlockLayout::Block& blk) { return blk.seg_len <= 32 ? 64 : kRowAhead; }

// The largest of 8 unsigned lanes.
inline uint32_t max_lane(__m256i m) {
  __m128i h = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  h = _mm_max_epu32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
  h = _mm_max_epu32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(h));
}

// The magnitude bits of the 32 floats at p into four accumulators (absmax_bits.h's rule).
inline void accumulate32(const float* p, __m256i am[4]) {
  const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
  for (int j = 0; j < 4; ++j) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8 * j));
    am[j] = _mm256_max_epu32(am[j], _mm256_and_si256(v, magnitude));
  }
}
// The largest lane of four accumulators.
inline uint32_t max_lane(const __m256i am[4]) {
  return max_lane(_mm256_max_epu32(_mm256_max_epu32(am[0], am[1]), _mm256_max_epu32(am[2], am[3])));
}

// Max |x| over a block; *bad set when it holds NaN or Inf (absmax_bits.h's rule).
float block_absmax(const float* x, const BlockLayout::Block& blk, int64_t row_len, bool* bad) {
  const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
  __m256i am[4];
  for (int j = 0; j < 4; ++j) am[j] = _mm256_setzero_si256();
  uint32_t tail = 0;
  const int64_t ahead = prefetch_distance(blk);
  if (blk.seg_len == 32) {  // a 32-wide tile: a row is one step of the loop below
    for (int64_t s = 0; s < blk.segments; ++s) {
      const float* p = x + blk.start + s * row_len;
      _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p + ahead + 16), _MM_HINT_T0);
      accumulate32(p, am);
    }
    return absmax_of_bits(max_lane(am), bad);
  }
  for (int64_t s = 0; s < blk.segments; ++s) {
    const float* p = x + blk.start + s * row_len;
    int64_t i = 0;
    for (; i + 32 <= blk.seg_len; i += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(p + i + ahead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p + i + ahead + 16), _MM_HINT_T0);
      accumulate32(p + i, am);
    }
    if (blk.seg_len < 32) {
      _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p + ahead + 16), _MM_HINT_T0);
    }
    for (; i + 8 <= blk.seg_len; i += 8) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i));
      am[0] = _mm256_max_epu32(am[0], _mm256_and_si256(v, magnitude));
    }
    for (; i < blk.seg_len; ++i) tail = std::max(tail, magnitude_bits(p[i]));
  }
  return absmax_of_bits(std::max(max_lane(am), tail), bad);
}

// The codes of a block under absmax amax: from x in the tensor's layout, or
// (packed) from a buffer holding the block's segments one after another. ahead:
// encode_run's (where a later block lies, to fetch it meanwhile).
void quantize_block(const float* x, bool packed, const BlockLayout::Block& blk, int64_t row_len,
                    float amax, const IndexRegs& r, uint8_t* q, int64_t ahead = 0) {
  const float scale = scale_of(amax);
  for (int64_t s = 0; s < blk.segments; ++s) {
    const int64_t off = blk.start + s * row_len;
    encode_run(x + (packed ? s * blk.seg_len : off), scale, blk.seg_len, r, q + off, ahead);
  }
}

// What the AdamW8bit step holds: both codes' indexes, the coefficients.
struct StepRegs {
  IndexRegs r1, r2;
  const float *code1, *code2;
  AdamWCoeffs c;
  __m256 b1, omb1, b2, omb2, decay, step, isb, eps;
  StepRegs(const CodeLut& lut1, const CodeLut& lut2, const AdamWCoeffs& k)
      : r1(lut1), r2(lut2), code1(lut1.code()), code2(lut2.code()), c(k),
        b1(_mm256_set1_ps(k.b1)), omb1(_mm256_set1_ps(k.one_minus_b1)), b2(_mm256_set1_ps(k.b2)),
        omb2(_mm256_set1_ps(k.one_minus_b2)), decay(_mm256_set1_ps(k.decay)),
        step(_mm256_set1_ps(k.step_size)), isb(_mm256_set1_ps(k.inv_sqrt_bc2)), eps(_mm256_set1_ps(k.eps)) {}
};

// A long row's inputs kRowAhead elements ahead, once a line (i, the
// step's offset in the row, counts by 8): what the hardware prefetcher does not
// start early enough past the caches (16 Mi parameters: 0.67-0.72 -> 0.86-0.93 of
// the fp32 step's speed; no change at 4 Mi).
inline void prefetch_row_ahead(int64_t e, int64_t i, const float* p, const float* g,
                               const uint8_t* q1, const uint8_t* q2) {
  if (i % 16 != 0) return;
  _mm_prefetch(reinterpret_cast<const char*>(p + e + kRowAhead), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(g + e + kRowAhead), _MM_HINT_T0);
  if (i % 64 != 0) return;
  _mm_prefetch(reinterpret_cast<const char*>(q1 + e + kRowAhead), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(q2 + e + kRowAhead), _MM_HINT_T0);
}

// A tile row's inputs two tiles ahead along the row (tiles read 32 rows at once:
// more streams than the hardware prefetcher follows; long rows do without).
inline void prefetch_tile_row(int64_t at, const float* p, const float* g, const uint8_t* q1,
                              const uint8_t* q2) {
  for (const float* x : {p + at, p + at + 16, g + at, g + at + 16}) {
    _mm_prefetch(reinterpret_cast<const char*>(x), _MM_HINT_T0);
  }
  _mm_prefetch(reinterpret_cast<const char*>(q1 + at), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(q2 + at), _MM_HINT_T0);
}

// The first half of a block's step: decode, update (adamw_update's operations one
// by one), the new moments packed into mbuf, vbuf, their max |.| into amax1, amax2.
void update_block(const StepRegs& R, float* p, const float* g, const uint8_t* q1,
                  const uint8_t* q2, float absmax1, float absmax2, const BlockLayout::Block& blk,
                  int64_t row_len, float* mbuf, float* vbuf, float* amax1, float* amax2) {
  const __m256 a1 = _mm256_set1_ps(absmax1), a2 = _mm256_set1_ps(absmax2);
  // the coefficients in registers (the stores below may alias R, so R's would be
  // reloaded every step: loads the gathers need)
  const __m256 b1 = R.b1, omb1 = R.omb1, b2 = R.b2, omb2 = R.omb2, decay = R.decay, step = R.step,
               isb = R.isb, eps = R.eps;
  const float *code1 = R.code1, *code2 = R.code2;
  __m256 am1 = _mm256_setzero_ps(), am2 = _mm256_setzero_ps();
  float t1 = 0.0f, t2 = 0.0f;
  for (int64_t s = 0; s < blk.segments; ++s) {
    const int64_t off = blk.start + s * row_len, k = s * blk.seg_len;
    if (blk.seg_len <= 32) prefetch_tile_row(off + 2 * blk.seg_len, p, g, q1, q2);
    int64_t i = 0;
    for (; i + 8 <= blk.seg_len; i += 8) {
      const int64_t e = off + i;
      if (blk.seg_len > 32) prefetch_row_ahead(e, i, p, g, q1, q2);
      const __m256 gj = _mm256_loadu_ps(g + e);
      const __m256 m = _mm256_add_ps(_mm256_mul_ps(b1, _mm256_mul_ps(decode8(q1 + e, code1), a1)),
                                     _mm256_mul_ps(omb1, gj));
      const __m256 v = _mm256_add_ps(_mm256_mul_ps(b2, _mm256_mul_ps(decode8(q2 + e, code2), a2)),
                                     _mm256_mul_ps(_mm256_mul_ps(omb2, gj), gj));
      const __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(v), isb), eps);
      const __m256 pj = _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(p + e), decay),
                                      _mm256_mul_ps(step, _mm256_div_ps(m, denom)));
      _mm256_storeu_ps(p + e, pj);
      _mm256_storeu_ps(mbuf + k + i, m);
      _mm256_storeu_ps(vbuf + k + i, v);
      am1 = _mm256_max_ps(am1, abs8(m));
      am2 = _mm256_max_ps(am2, abs8(v));
    }
    for (; i < blk.seg_len; ++i) {
      const int64_t e = off + i;
      float m = R.code1[q1[e]] * absmax1, v = R.code2[q2[e]] * absmax2;
      adamw_update(p[e], m, v, g[e], R.c);
      mbuf[k + i] = m, vbuf[k + i] = v;
      t1 = t1 < std::fabs(m) ? std::fabs(m) : t1;
      t2 = t2 < std::fabs(v) ? std::fabs(v) : t2;
    }
  }
  const float h1 = hmax(am1), h2 = hmax(am2);
  *amax1 = h1 < t1 ? t1 : h1;
  *amax2 = h2 < t2 ? t2 : h2;
}

// torch.lerp's float arithmetic (cpu/portable.cpp's torch_lerp), the branch
// (|w| < 0.5) chosen by the caller.
inline __m256 torch_lerp(__m256 a, __m256 b, bool small, __m256 w, __m256 one_minus_w) {
  const __m256 d = _mm256_sub_ps(b, a);
  return small ? _mm256_add_ps(a, _mm256_mul_ps(w, d)) : _mm256_sub_ps(b, _mm256_mul_ps(d, one_minus_w));
}
inline float torch_lerp(float a, float b, float w) {
  return std::fabs(w) < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w);
}

}  // namespace

// F16C too: the float8 kernels of this set decode by its conversion (fp8_avx2.cpp);
// every CPU with AVX2 has it.
bool supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

void quantize_blocks(const float* x, const BlockLayout& L, const CodeLut& lut, uint8_t* q,
                     float* absmax, int64_t b0, int64_t b1, bool* bad) {
  // The AVX-512 kernels' order: each absmax a block ahead of its encode, which
  // fetches the block after next; where both blocks are runs of 32 (1-D blocks of
  // a multiple of 32, whole 32-wide tiles: run i at row(block, i)) and the table
  // exact, the next block's absmax run by run beside this block's encode.
  const IndexRegs r(lut);
  if (b0 >= b1) return;
  const int64_t w = L.max_block_elems(), row_len = L.row_len;
  const bool tiles = L.shape.is_tile();
  const int64_t runs = tiles ? L.shape.tile_rows : w / 32;
  auto regular = [&](const BlockLayout::Block& blk) {
    return r.entry && (tiles ? blk.seg_len == 32 && blk.segments == L.shape.tile_rows
                             : blk.seg_len == w && w % 32 == 0);
  };
  auto row = [&](const BlockLayout::Block& blk, int64_t i) {
    return blk.start + (tiles ? i * row_len : 32 * i);
  };
  auto blk = L.block(b0);
  float amax = block_absmax(x, blk, row_len, bad);
  for (int64_t b = b0; b < b1; ++b) {
    const bool last = b + 1 == b1;
    const auto next = last ? blk : L.block(b + 1);
    const int64_t ahead = b + 2 < b1 ? L.block(b + 2).start - blk.start : 0;
    float next_amax = 0.0f;
    if (!last && regular(blk) && regular(next)) {
      const __m256 sc = _mm256_set1_ps(scale_of(amax));
      __m256i am[4];
      for (int j = 0; j < 4; ++j) am[j] = _mm256_setzero_si256();
      for (int64_t i = 0; i < runs; ++i) {
        accumulate32(x + row(next, i), am);
        const int64_t at = row(blk, i);
        encode32_table(x + at, sc, r, q + at, ahead);
      }
      next_amax = absmax_of_bits(max_lane(am), bad);
    } else {
      next_amax = last ? 0.0f : block_absmax(x, next, row_len, bad);
      quantize_block(x, false, blk, row_len, amax, r, q, ahead);
    }
    absmax[b] = amax;
    blk = next;
    amax = next_amax;
  }
}

void dequantize_blocks(const uint8_t* q, const float* absmax, const BlockLayout& L,
                       const CodeLut& lut, float* out, int64_t b0, int64_t b1) {
  // Outputs past the caches go around them (streaming stores, as the AVX-512
  // kernels: no read for ownership, half the memory traffic) where 32-byte aligned.
  const bool stream = L.numel >= (int64_t{1} << 20);
  struct Fence {
    bool on;
    ~Fence() { if (on) _mm_sfence(); }
  } fence{stream};
  const float* code = lut.code();
  for (int64_t b = b0; b < b1; ++b) {
    const auto blk = L.block(b);
    const float a = absmax[b];
    const __m256 av = _mm256_set1_ps(a);
    for (int64_t s = 0; s < blk.segments; ++s) {
      const int64_t off = blk.start + s * L.row_len;
      int64_t i = 0;
      if (stream && (reinterpret_cast<uintptr_t>(out + off) & 31) == 0) {
        for (; i + 8 <= blk.seg_len; i += 8) {
          _mm256_stream_ps(out + off + i, _mm256_mul_ps(decode8(q + off + i, code), av));
        }
      }
      for (; i + 8 <= blk.seg_len; i += 8) {
        _mm256_storeu_ps(out + off + i, _mm256_mul_ps(decode8(q + off + i, code), av));
      }
      for (; i < blk.seg_len; ++i) out[off + i] = code[q[off + i]] * a;
    }
  }
}

void adamw8bit_blocks(float* p, const float* g, uint8_t* q1, float* absmax1, uint8_t* q2,
                      float* absmax2, const BlockLayout& L, const CodeLut& lut1,
                      const CodeLut& lut2, const AdamWCoeffs& c, int64_t b0, int64_t b1,
                      float* mbuf, float* vbuf) {
  const StepRegs R(lut1, lut2, c);
  for (int64_t b = b0; b < b1; ++b) {
    const auto blk = L.block(b);
    float amax1, amax2;
    update_block(R, p, g, q1, q2, absmax1[b], absmax2[b], blk, L.row_len, mbuf, vbuf, &amax1, &amax2);
    quantize_block(mbuf, true, blk, L.row_len, amax1, R.r1, q1);
    quantize_block(vbuf, true, blk, L.row_len, amax2, R.r2, q2);
    absmax1[b] = amax1;
    absmax2[b] = amax2;
  }
}

void adamw8bit_begin_blocks(float* p, const float* g, const uint8_t* q1, const float* absmax1,
                            const uint8_t* q2, const float* absmax2, const BlockLayout& L,
                            const CodeLut& lut1, const CodeLut& lut2, const AdamWCoeffs& c,
                            int64_t b0, int64_t b1, float* scratch, float* amax1, float* amax2) {
  const StepRegs R(lut1, lut2, c);
  const int64_t w = L.max_block_elems();
  for (int64_t b = b0; b < b1; ++b) {
    update_block(R, p, g, q1, q2, absmax1[b], absmax2[b], L.block(b), L.row_len,
                 scratch + 2 * b * w, scratch + (2 * b + 1) * w, amax1 + b, amax2 + b);
  }
}

void adamw8bit_end_blocks(const float* scratch, const BlockLayout& L, const CodeLut& lut1,
                          const CodeLut& lut2, const float* agreed1, const float* agreed2,
                          uint8_t* q1, float* absmax1, uint8_t* q2, float* absmax2, int64_t b0,
                          int64_t b1) {
  const IndexRegs r1(lut1), r2(lut2);
  const int64_t w = L.max_block_elems();
  for (int64_t b = b0; b < b1; ++b) {
    const auto blk = L.block(b);
    quantize_block(scratch + 2 * b * w, true, blk, L.row_len, agreed1[b], r1, q1);
    quantize_block(scratch + (2 * b + 1) * w, true, blk, L.row_len, agreed2[b], r2, q2);
    absmax1[b] = agreed1[b];
    absmax2[b] = agreed2[b];
  }
}

void momentum8bit_blocks(const float* g, const uint8_t* q, const float* absmax, const BlockLayout& L,
                         const CodeLut& lut, float beta, bool nesterov, uint8_t* q_out,
                         float* absmax_out, float* u, int64_t b0, int64_t b1, float* mbuf,
                         bool* bad) {
  const IndexRegs r(lut);
  const float* code = lut.code();
  const float w = 1.0f - beta;
  const bool small_w = std::fabs(w) < 0.5f, small_beta = std::fabs(beta) < 0.5f;
  const __m256 wv = _mm256_set1_ps(w), omw = _mm256_set1_ps(1.0f - w);
  const __m256 bv = _mm256_set1_ps(beta), omb = _mm256_set1_ps(1.0f - beta);
  const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
  for (int64_t b = b0; b < b1; ++b) {
    const auto blk = L.block(b);
    const float a = absmax[b];
    const __m256 av = _mm256_set1_ps(a);
    // the new momentum's max |m| as it is made (block_absmax's integer max)
    __m256i am = _mm256_setzero_si256();
    uint32_t tail = 0;
    for (int64_t s = 0; s < blk.segments; ++s) {
      const int64_t off = blk.start + s * L.row_len, k = s * blk.seg_len;
      int64_t i = 0;
      for (; i + 8 <= blk.seg_len; i += 8) {
        // the gradient kRowAhead elements ahead (16M: 0.59-0.64 -> 0.65-0.70 of memcpy);
        // prefetching the codes too made it a third slower at 4M (measured, not understood)
        if (blk.seg_len > 32 && i % 16 == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(g + off + i + kRowAhead), _MM_HINT_T0);
        }
        const __m256 gj = _mm256_loadu_ps(g + off + i);
        const __m256 m = torch_lerp(_mm256_mul_ps(decode8(q + off + i, code), av), gj, small_w, wv, omw);
        _mm256_storeu_ps(mbuf + k + i, m);
        _mm256_storeu_ps(u + off + i, nesterov ? torch_lerp(gj, m, small_beta, bv, omb) : m);
        am = _mm256_max_epu32(am, _mm256_and_si256(_mm256_castps_si256(m), magnitude));
      }
      for (; i < blk.seg_len; ++i) {
        const float m = torch_lerp(code[q[off + i]] * a, g[off + i], w);
        mbuf[k + i] = m;
        u[off + i] = nesterov ? torch_lerp(g[off + i], m, beta) : m;
        tail = std::max(tail, magnitude_bits(m));
      }
    }
    const float amax = absmax_of_bits(std::max(max_lane(am), tail), bad);
    quantize_block(mbuf, true, blk, L.row_len, amax, r, q_out);
    absmax_out[b] = amax;
  }
}

}  // namespace rfsdp::quant::cpu::avx2

#pragma GCC pop_options

#else  // not x86-64 GCC: supported() is false, so nothing below is reached

#include <stdexcept>

namespace rfsdp::quant::cpu::avx2 {
namespace {
[[noreturn]] void absent() { throw std::logic_error("the AVX2 quantisation kernels are not built here"); }
}  // namespace
bool supported() { return false; }
void quantize_blocks(const float*, const BlockLayout&, const CodeLut&, uint8_t*, float*, int64_t,
                     int64_t, bool*) { absent(); }
void dequantize_blocks(const uint8_t*, const float*, const BlockLayout&, const CodeLut&, float*,
                       int64_t, int64_t) { absent(); }
void adamw8bit_blocks(float*, const float*, uint8_t*, float*, uint8_t*, float*, const BlockLayout&,
                      const CodeLut&, const CodeLut&, const AdamWCoeffs&, int64_t, int64_t, float*,
                      float*) { absent(); }
void adamw8bit_begin_blocks(float*, const float*, const uint8_t*, const float*, const uint8_t*,
                            const float*, const BlockLayout&, const CodeLut&, const CodeLut&,
                            const AdamWCoeffs&, int64_t, int64_t, float*, float*, float*) { absent(); }
void adamw8bit_end_blocks(const float*, const BlockLayout&, const CodeLut&, const CodeLut&,
                          const float*, const float*, uint8_t*, float*, uint8_t*, float*, int64_t,
                          int64_t) { absent(); }
void momentum8bit_blocks(const float*, const uint8_t*, const float*, const BlockLayout&,
                         const CodeLut&, float, bool, uint8_t*, float*, float*, int64_t, int64_t,
                         float*, bool*) { absent(); }
}  // namespace rfsdp::quant::cpu::avx2

#endif
