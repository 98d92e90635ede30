#include "quant/kernels/cpu/avx512.h"

#include <cmath>
#include <cstring>
#include <type_traits>

#include "quant/formats/absmax_bits.h"
#include "quant/kernels/cpu/gathers.h"

// GCC only: the AVX-512 region below uses #pragma GCC target (clang takes the stubs).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>

// Only the code below is compiled for AVX-512; the headers above keep the
// baseline target, so no inline function they define is emitted with it.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi")

namespace rfsdp::quant::cpu::avx512 {

namespace {

// 64 elements at a time: four zmm of 16 floats, zmm s holding elements 16s..16s+15
// ("natural" order). packus leaves 64 bytes in "packed" order: byte 16l + 4s + i
// belongs to element 16s + 4l + i (l the 128-bit lane, i < 4). Swapping the two
// 2-bit fields converts either way, so one vpermb with kSwap does both.
struct SwapIndex {
  alignas(64) uint8_t v[64];
  constexpr SwapIndex() : v() {
    for (int p = 0; p < 64; ++p) v[p] = static_cast<uint8_t>(16 * ((p >> 2) & 3) + 4 * (p >> 4) + (p & 3));
  }
};
constexpr SwapIndex kSwap;

inline __m512i swap_order(__m512i bytes) {
  return _mm512_permutexvar_epi8(_mm512_load_si512(kSwap.v), bytes);
}

// Four zmm of int32 in [0, 255] (saturated) -> 64 bytes, packed order.
inline __m512i pack_bytes(__m512i a, __m512i b, __m512i c, __m512i d) {
  return _mm512_packus_epi16(_mm512_packus_epi32(a, b), _mm512_packus_epi32(c, d));
}

// Four byte planes (packed order) -> four zmm of 32-bit words, natural order.
inline void unpack_planes(__m512i p0, __m512i p1, __m512i p2, __m512i p3, __m512 out[4]) {
  const __m512i lo01 = _mm512_unpacklo_epi8(p0, p1), hi01 = _mm512_unpackhi_epi8(p0, p1);
  const __m512i lo23 = _mm512_unpacklo_epi8(p2, p3), hi23 = _mm512_unpackhi_epi8(p2, p3);
  out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23));
  out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23));
  out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23));
  out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23));
}

// A 256-entry float table as four byte planes of four zmm each.
struct Table256 {
  __m512i t[4][4];
  explicit Table256(const uint8_t* planes) {
    for (int k = 0; k < 4; ++k) {
      for (int j = 0; j < 4; ++j) t[k][j] = _mm512_loadu_si512(planes + 256 * k + 64 * j);
    }
  }
  // Entries idx (64 bytes, any order) of plane k; hi = the top bits of idx.
  __m512i plane(int k, __m512i idx, __mmask64 hi) const {
    const __m512i lo = _mm512_permutex2var_epi8(t[k][0], idx, t[k][1]);
    const __m512i up = _mm512_permutex2var_epi8(t[k][2], idx, t[k][3]);
    return _mm512_mask_blend_epi8(hi, lo, up);
  }
  // Only the lower 128 entries (idx taken mod 128).
  __m512i plane_low(int k, __m512i idx) const {
    return _mm512_permutex2var_epi8(t[k][0], idx, t[k][1]);
  }
};

// 64 codes (natural order) -> code values, natural order.
inline void decode64(__m512i q, const Table256& code, __m512 out[4]) {
  const __m512i qp = swap_order(q);
  const __mmask64 hi = _mm512_movepi8_mask(qp);
  unpack_planes(code.plane(0, qp, hi), code.plane(1, qp, hi), code.plane(2, qp, hi),
                code.plane(3, qp, hi), out);
}

// The arithmetic index of a code in registers (CodeIndex, lane-wise), and where
// the code's table is exact and gathers are in use (cpu/gathers.h) its entries by
// top 16 bits (encode64_table's).
struct IndexRegs {
  __m512 lo, key_a, key_b, a, b;
  Table256 mid;
  const int32_t* entry;  // null where the table is not exact or gathers are off
  const float* code_mid;
  explicit IndexRegs(const CodeLut& lut)
      : lo(_mm512_set1_ps(lut.index()->lo)),
        key_a(_mm512_castsi512_ps(_mm512_loadu_si512(lut.index()->binade_key))),
        key_b(_mm512_castsi512_ps(_mm512_loadu_si512(lut.index()->binade_key + 16))),
        a(_mm512_loadu_ps(lut.index()->a)),
        b(_mm512_loadu_ps(lut.index()->b)),
        mid(lut.index_mid_planes()),
        entry(gathers_used() && lut.table_exact() ? lut.entry_by_top16() : nullptr),
        code_mid(lut.mid()) {}
};

// How the index sees v: |v| (a folded index), max(v, lo) with lo >= 0 (w has no
// sign bit), or max(v, lo) with lo < 0.
enum class Domain { kFolded, kNonNegative, kSigned };

// CodeIndex::candidate for 16 values w.
template <Domain D>
inline __m512i candidate16(__m512 w, const IndexRegs& r) {
  static_assert(CodeIndex::kLowestBinade % 32 == 0, "the binade is the exponent's low 5 bits");
  const __m512i mag = D == Domain::kSigned
                          ? _mm512_and_si512(_mm512_castps_si512(w), _mm512_set1_epi32(0x7FFFFFFF))
                          : _mm512_castps_si512(w);
  // permutex2var reads the low 5 bits of the exponent: the binade
  const __m512i e = _mm512_max_epu32(_mm512_srli_epi32(mag, 23),
                                     _mm512_set1_epi32(CodeIndex::kLowestBinade));
  const __m512 key = _mm512_permutex2var_ps(r.key_a, e, r.key_b);
  __m512i lvl = _mm512_and_si512(_mm512_castps_si512(key), _mm512_set1_epi32(15));
  lvl = _mm512_mask_add_epi32(lvl, _mm512_cmp_ps_mask(w, key, _CMP_GE_OQ), lvl,
                              _mm512_set1_epi32(1));
  const __m512 t = _mm512_fmsub_ps(w, _mm512_permutexvar_ps(lvl, r.a), _mm512_permutexvar_ps(lvl, r.b));
  return _mm512_cvttps_epi32(t);
}

// Nearest codes of 64 values v (natural order) -> 64 bytes, natural order:
// CodeIndex::nearest lane by lane.
template <Domain D>
inline __m512i encode64(const __m512 v[4], const IndexRegs& r) {
  static_assert(CodeIndex::kLowestBinade % 32 == 0, "binade lookup reads 5 bits");
  constexpr bool fold = D == Domain::kFolded;
  __m512 w[4];
  __m512i f[4];
  for (int s = 0; s < 4; ++s) {
    w[s] = fold ? _mm512_abs_ps(v[s]) : _mm512_max_ps(v[s], r.lo);
    f[s] = candidate16<D>(w[s], r);
  }
  const __m512i fp = pack_bytes(f[0], f[1], f[2], f[3]);  // CodeIndex::pack_saturate
  __m512 m[4];
  if (fold) {
    unpack_planes(r.mid.plane_low(0, fp), r.mid.plane_low(1, fp), r.mid.plane_low(2, fp),
                  r.mid.plane_low(3, fp), m);
  } else {
    const __mmask64 hi = _mm512_movepi8_mask(fp);
    unpack_planes(r.mid.plane(0, fp, hi), r.mid.plane(1, fp, hi), r.mid.plane(2, fp, hi),
                  r.mid.plane(3, fp, hi), m);
  }
  const __m512i one = _mm512_set1_epi32(1);
  __m512i n[4];
  for (int s = 0; s < 4; ++s) {
    if (fold) {
      // negative v: 254 - (f + [w >= m]), and w >= m is w > (the float below m)
      const __mmask16 neg = _mm512_movepi32_mask(_mm512_castps_si512(v[s]));
      const __m512i mi = _mm512_castps_si512(m[s]);
      const __m512 ma = _mm512_castsi512_ps(_mm512_mask_sub_epi32(mi, neg, mi, one));
      const __m512i r1 = _mm512_mask_add_epi32(f[s], _mm512_cmp_ps_mask(w[s], ma, _CMP_GT_OQ), f[s], one);
      n[s] = _mm512_mask_sub_epi32(r1, neg, _mm512_set1_epi32(254), r1);
    } else {
      n[s] = _mm512_mask_add_epi32(f[s], _mm512_cmp_ps_mask(w[s], m[s], _CMP_GT_OQ), f[s], one);
    }
  }
  return swap_order(pack_bytes(n[0], n[1], n[2], n[3]));
}

// CodeLut::nearest for 64 values (natural order) -> 64 bytes, natural order, by
// gathers of the table entry by each value's top 16 bits (the AVX2 kernels' rule:
// CodeLut::entry_by_top16; the exact midpoint only within 255 ulps of it). It
// loads where encode64 shuffles, so a step that encodes two moments runs one of
// each side by side.
inline __m512i encode64_table(const __m512 v[4], const int32_t* entry, const float* mid) {
  const __m512i low = _mm512_set1_epi32(0xFF), one = _mm512_set1_epi32(1);
  __m512i n[4];
  for (int s = 0; s < 4; ++s) {
    const __m512i bits = _mm512_castps_si512(v[s]);
    const __m512i e = _mm512_i32gather_epi32(_mm512_srli_epi32(bits, 16), entry, 4);
    const __m512i t = _mm512_and_si512(e, low);
    __m512 m = _mm512_castsi512_ps(_mm512_andnot_si512(low, e));
    const __mmask16 near = _mm512_testn_epi32_mask(_mm512_xor_si512(bits, e), _mm512_set1_epi32(~0xFF));
    if (near) m = _mm512_mask_i32gather_ps(m, near, t, mid, 4);
    n[s] = _mm512_mask_add_epi32(t, _mm512_cmp_ps_mask(v[s], m, _CMP_GT_OQ), t, one);
  }
  return swap_order(pack_bytes(n[0], n[1], n[2], n[3]));
}

inline __mmask16 lanes(int64_t k, int s) {
  const int64_t left = k - 16 * s;
  return left >= 16 ? __mmask16(0xFFFF) : (left > 0 ? __mmask16((1u << left) - 1) : __mmask16(0));
}
inline __mmask32 bytes_mask(int64_t k) { return k >= 32 ? ~__mmask32(0) : (__mmask32(1) << k) - 1; }

// 64 lanes of a block: lanes 32h..32h+31 are up to 32 consecutive elements at
// offset off[h] (and at buf[h] in the block's scratch, segment after segment).
// Long segments give chunks of 64 consecutive elements; segments of 32 or fewer
// (tiles) go two to a chunk, so no lanes idle. Masked loads never fault, so an
// empty half may point anywhere.
struct Chunk {
  int64_t off[2], buf[2];
  static constexpr bool dense = false;  // lanes masked as lane[] and bytes[] say
  bool full;            // 64 consecutive elements (off[1] == off[0] + 32, buf likewise)
  __mmask16 lane[4];    // live lanes of zmm j (elements 16j..16j+15)
  __mmask32 bytes[2];   // live bytes of each half

  Chunk(int64_t off0, int64_t off1, int64_t buf0, int64_t buf1, int64_t n0, int64_t n1)
      : off{off0, off1}, buf{buf0, buf1},
        full(n0 == 32 && n1 == 32 && off1 == off0 + 32 && buf1 == buf0 + 32),
        lane{lanes(n0, 0), lanes(n0, 1), lanes(n1, 0), lanes(n1, 1)},
        bytes{bytes_mask(n0), bytes_mask(n1)} {}
};

// 64 consecutive elements (most chunks of long segments): the same fields,
// known full when compiled, so its loads, stores and lane masks take no masks.
struct FullChunk {
  static constexpr bool full = true, dense = true;
  static constexpr __mmask16 lane[4] = {0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF};
  static constexpr __mmask32 bytes[2] = {0xFFFFFFFFu, 0xFFFFFFFFu};
  int64_t off[2], buf[2];
  FullChunk(int64_t off0, int64_t buf0) : off{off0, off0 + 32}, buf{buf0, buf0 + 32} {}
};

// Two whole rows of a 32-wide tile: every lane live, the halves apart, so its
// loads and stores take two addresses but no masks.
struct PairChunk {
  static constexpr bool full = false, dense = true;
  static constexpr __mmask16 lane[4] = {0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF};
  static constexpr __mmask32 bytes[2] = {0xFFFFFFFFu, 0xFFFFFFFFu};
  int64_t off[2], buf[2];
  PairChunk(int64_t off0, int64_t off1, int64_t buf0) : off{off0, off1}, buf{buf0, buf0 + 32} {}
};

template <class F>
inline void for_chunks(const BlockLayout::Block& blk, int64_t row_len, F&& f) {
  const int64_t len = blk.seg_len;
  if (len <= 32) {
    for (int64_t s = 0; s < blk.segments; s += 2) {
      const int64_t off = blk.start + s * row_len;
      if (len == 32 && s + 1 < blk.segments) {
        f(PairChunk(off, off + row_len, s * len));
        continue;
      }
      f(Chunk(off, off + row_len, s * len, (s + 1) * len, len, s + 1 < blk.segments ? len : 0));
    }
    return;
  }
  for (int64_t s = 0; s < blk.segments; ++s) {
    const int64_t off = blk.start + s * row_len;
    int64_t i = 0;
    for (; i + 64 <= len; i += 64) f(FullChunk(off + i, s * len + i));
    if (i < len) {
      const int64_t k = len - i;
      f(Chunk(off + i, off + i + 32, s * len + i, s * len + i + 32, k < 32 ? k : 32,
              k > 32 ? k - 32 : 0));
    }
  }
}

// Regular blocks, whose chunks run in step with another block's (the quantise
// and AdamW8bit pipelines): regular(block) says a block is whole, chunk(block, i)
// is its chunk i of chunks(). Long rows: 1-D blocks of w elements, w a multiple
// of 64, 64 consecutive a chunk.
struct RowRuns {
  int64_t w;
  int64_t chunks() const { return w / 64; }
  bool regular(const BlockLayout::Block& blk) const { return blk.seg_len == w; }
  FullChunk chunk(const BlockLayout::Block& blk, int64_t i) const {
    return FullChunk(blk.start + 64 * i, 64 * i);
  }
};
// Whole 32 x 32 tiles, two rows a chunk (for_chunks' order).
struct TilePairs {
  int64_t row_len;
  int64_t chunks() const { return 16; }
  bool regular(const BlockLayout::Block& blk) const { return blk.segments == 32 && blk.seg_len == 32; }
  PairChunk chunk(const BlockLayout::Block& blk, int64_t i) const {
    const int64_t off = blk.start + 2 * i * row_len;
    return PairChunk(off, off + row_len, 64 * i);
  }
};
// Other layouts: no block regular.
struct NoRuns {
  int64_t chunks() const { return 0; }
  bool regular(const BlockLayout::Block&) const { return false; }
  FullChunk chunk(const BlockLayout::Block& blk, int64_t) const { return FullChunk(blk.start, 0); }
};

template <class C>
inline void load_floats(const float* x, const int64_t off[2], const C& c, __m512 v[4]) {
  if (c.full) {
    for (int j = 0; j < 4; ++j) v[j] = _mm512_loadu_ps(x + off[0] + 16 * j);
    return;
  }
  if constexpr (C::dense) {
    for (int j = 0; j < 4; ++j) v[j] = _mm512_loadu_ps(x + off[j >> 1] + 16 * (j & 1));
    return;
  }
  for (int j = 0; j < 4; ++j) v[j] = _mm512_maskz_loadu_ps(c.lane[j], x + off[j >> 1] + 16 * (j & 1));
}
template <class C>
inline void store_floats(float* x, const int64_t off[2], const C& c, const __m512 v[4]) {
  if (c.full) {
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(x + off[0] + 16 * j, v[j]);
    return;
  }
  if constexpr (C::dense) {
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(x + off[j >> 1] + 16 * (j & 1), v[j]);
    return;
  }
  for (int j = 0; j < 4; ++j) _mm512_mask_storeu_ps(x + off[j >> 1] + 16 * (j & 1), c.lane[j], v[j]);
}
template <class C>
inline __m512i load_bytes(const uint8_t* q, const C& c) {
  if (c.full) return _mm512_loadu_si512(q + c.off[0]);
  if constexpr (C::dense) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c.off[0]));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c.off[1]));
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
  const __m256i lo = _mm256_maskz_loadu_epi8(c.bytes[0], q + c.off[0]);
  const __m256i hi = _mm256_maskz_loadu_epi8(c.bytes[1], q + c.off[1]);
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
template <class C>
inline void store_bytes(uint8_t* q, const C& c, __m512i b) {
  if (c.full) return _mm512_storeu_si512(q + c.off[0], b);
  if constexpr (C::dense) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + c.off[0]), _mm512_castsi512_si256(b));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + c.off[1]), _mm512_extracti64x4_epi64(b, 1));
    return;
  }
  _mm256_mask_storeu_epi8(q + c.off[0], c.bytes[0], _mm512_castsi512_si256(b));
  _mm256_mask_storeu_epi8(q + c.off[1], c.bytes[1], _mm512_extracti64x4_epi64(b, 1));
}

// Software prefetch, `ahead` elements past each half of a chunk (one line of
// floats or bytes): blocks are short runs, and tiles read 32 rows at once, more
// streams than the hardware prefetcher follows.
constexpr int64_t kRowAhead = 1024;  // 4 KiB of floats
inline int64_t prefetch_distance(const BlockLayout::Block& blk) {
  return blk.seg_len <= 32 ? 64 : kRowAhead;  // two tiles along the row, or along a long row
}
template <class T, class C>
inline void prefetch(const T* x, const C& c, int64_t ahead) {
  for (int h = 0; h < 2; ++h) {
    _mm_prefetch(reinterpret_cast<const char*>(x + c.off[h] + ahead), _MM_HINT_T0);
    if (sizeof(T) * 32 > 64) {
      _mm_prefetch(reinterpret_cast<const char*>(x + c.off[h] + ahead + 64 / sizeof(T)), _MM_HINT_T0);
    }
  }
}

// A block's max |x| in four accumulators (absmax_bits.h's rule: two operations
// an element; four, so a loop runs at load speed, not max latency): a chunk's
// floats at c.off added, and the block's absmax at the end (*bad set when it
// holds NaN or Inf).
struct AbsmaxAcc {
  __m512i am[4];
  AbsmaxAcc() {
    for (int j = 0; j < 4; ++j) am[j] = _mm512_setzero_si512();
  }
  template <class C>
  __attribute__((always_inline)) void add(const float* x, const C& c) {
    const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
    __m512 v[4];
    load_floats(x, c.off, c, v);
    for (int j = 0; j < 4; ++j) {
      am[j] = _mm512_max_epu32(am[j], _mm512_and_si512(_mm512_castps_si512(v[j]), magnitude));
    }
  }
  __attribute__((always_inline)) float absmax(bool* bad) const {
    const __m512i a = _mm512_max_epu32(_mm512_max_epu32(am[0], am[1]), _mm512_max_epu32(am[2], am[3]));
    return absmax_of_bits(_mm512_reduce_max_epu32(a), bad);
  }
};

// Max |x| over a block; *bad set when it holds NaN or Inf.
float block_absmax(const float* x, const BlockLayout::Block& blk, int64_t row_len, bool* bad) {
  AbsmaxAcc acc;
  const int64_t ahead = prefetch_distance(blk);
  for_chunks(blk, row_len, [&](const auto& c) {
    prefetch(x, c, ahead);
    acc.add(x, c);
  });
  return acc.absmax(bad);
}

// Codes of a block: x (at the chunks' off, or at their buf when from_buf) times scale.
// Where the code's table is exact and gathers are in use (cpu/gathers.h: Intel by
// default), every other chunk by the table's gathers: they
// load where the index shuffles, so consecutive chunks overlap (quantise and the
// 8-bit momentum step 3-4 % faster at 4 Mi). next: how far on a later block's
// elements lie, to prefetch while this one encodes (0: none; quantize_blocks_by
// gives the block after next); the hardware's stream runs about a kilobyte
// ahead, so without it a block's absmax waits on memory past that (2048-element
// blocks: 0.33 -> 0.30 ns a value).
template <Domain D, class C>
__attribute__((always_inline)) inline void quantize_chunk(const float* x, const int64_t at[2],
                                                          const C& c, __m512 sc, const IndexRegs& r,
                                                          bool by_table, uint8_t* q) {
  __m512 v[4];
  load_floats(x, at, c, v);
  for (int j = 0; j < 4; ++j) v[j] = _mm512_mul_ps(v[j], sc);
  store_bytes(q, c, by_table ? encode64_table(v, r.entry, r.code_mid) : encode64<D>(v, r));
}

template <Domain D>
void quantize_block(const float* x, bool from_buf, const BlockLayout::Block& blk, int64_t row_len,
                    float scale, const IndexRegs& r, uint8_t* q, int64_t next = 0) {
  const __m512 sc = _mm512_set1_ps(scale);
  bool by_table = false;
  for_chunks(blk, row_len, [&](const auto& c) {
    if (next) prefetch(x, c, next);
    by_table = r.entry && !by_table;
    quantize_chunk<D>(x, from_buf ? c.buf : c.off, c, sc, r, by_table, q);
  });
}

// Each block's absmax is taken a block ahead of its encode: the encode then
// starts on a scale already known, not on a reduction and a division just made
// (the encode waited on them: 256-element blocks 0.305 -> 0.27 ns a value). Where
// both blocks are regular (runs: RowRuns, TilePairs), the next one's absmax runs
// chunk by chunk beside this one's encode, its loads beside the encode's work.
template <Domain D, class Runs>
void quantize_blocks_by(const float* x, const BlockLayout& L, const IndexRegs& r, uint8_t* q,
                        float* absmax, int64_t b0, int64_t b1, bool* bad, const Runs& runs) {
  if (b0 >= b1) return;
  auto blk = L.block(b0);
  float amax = block_absmax(x, blk, L.row_len, bad);
  for (int64_t b = b0; b < b1; ++b) {
    const bool last = b + 1 == b1;
    const auto next = last ? blk : L.block(b + 1);
    // the block after next is the one to fetch now: next is being read
    const int64_t ahead = b + 2 < b1 ? L.block(b + 2).start - blk.start : 0;
    const float scale = scale_of(amax);
    float next_amax = 0.0f;
    if (!last && runs.regular(blk) && runs.regular(next)) {
      const __m512 sc = _mm512_set1_ps(scale);
      AbsmaxAcc acc;
      for (int64_t i = 0; i < runs.chunks(); ++i) {
        acc.add(x, runs.chunk(next, i));
        const auto c = runs.chunk(blk, i);
        if (ahead) prefetch(x, c, ahead);
        quantize_chunk<D>(x, c.off, c, sc, r, r.entry && i % 2 == 0, q);
      }
      next_amax = acc.absmax(bad);
    } else {
      next_amax = last ? 0.0f : block_absmax(x, next, L.row_len, bad);
      quantize_block<D>(x, false, blk, L.row_len, scale, r, q, ahead);
    }
    absmax[b] = amax;
    blk = next;
    amax = next_amax;
  }
}

template <Domain D>
void quantize_blocks_in(const float* x, const BlockLayout& L, const IndexRegs& r, uint8_t* q,
                        float* absmax, int64_t b0, int64_t b1, bool* bad) {
  const int64_t w = L.max_block_elems();
  if (!L.shape.is_tile() && w % 64 == 0) {
    quantize_blocks_by<D>(x, L, r, q, absmax, b0, b1, bad, RowRuns{w});
  } else if (L.shape.tile_rows == 32 && L.shape.tile_cols == 32) {
    quantize_blocks_by<D>(x, L, r, q, absmax, b0, b1, bad, TilePairs{L.row_len});
  } else {
    quantize_blocks_by<D>(x, L, r, q, absmax, b0, b1, bad, NoRuns{});
  }
}

Domain domain_of(const CodeIndex& ix) {
  return ix.fold ? Domain::kFolded : (ix.lo >= 0.0f ? Domain::kNonNegative : Domain::kSigned);
}

// quantize_block for a domain known only at run time.
void quantize_block_in(Domain d, const float* x, bool from_buf, const BlockLayout::Block& blk,
                       int64_t row_len, float scale, const IndexRegs& r, uint8_t* q) {
  switch (d) {
    case Domain::kFolded: return quantize_block<Domain::kFolded>(x, from_buf, blk, row_len, scale, r, q);
    case Domain::kNonNegative:
      return quantize_block<Domain::kNonNegative>(x, from_buf, blk, row_len, scale, r, q);
    case Domain::kSigned: return quantize_block<Domain::kSigned>(x, from_buf, blk, row_len, scale, r, q);
  }
}

}  // namespace

bool supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vbmi");
}

void quantize_blocks(const float* x, const BlockLayout& L, const CodeLut& lut, uint8_t* q,
                     float* absmax, int64_t b0, int64_t b1, bool* bad) {
  const IndexRegs r(lut);
  switch (domain_of(*lut.index())) {
    case Domain::kFolded:
      return quantize_blocks_in<Domain::kFolded>(x, L, r, q, absmax, b0, b1, bad);
    case Domain::kNonNegative:
      return quantize_blocks_in<Domain::kNonNegative>(x, L, r, q, absmax, b0, b1, bad);
    case Domain::kSigned:
      return quantize_blocks_in<Domain::kSigned>(x, L, r, q, absmax, b0, b1, bad);
  }
}

void dequantize_blocks(const uint8_t* q, const float* absmax, const BlockLayout& L,
                       const CodeLut& lut, float* out, int64_t b0, int64_t b1) {
  // Outputs past the caches go around them (streaming stores: no read for
  // ownership, half the memory traffic); smaller ones stay for their reader.
  const bool stream = L.numel >= (int64_t{1} << 20);
  struct Fence {
    bool on;
    ~Fence() { if (on) _mm_sfence(); }
  } fence{stream};
  const Table256 code(lut.code_planes());
  for (int64_t b = b0; b < b1; ++b) {
    const __m512 a = _mm512_set1_ps(absmax[b]);
    const auto blk = L.block(b);
    const int64_t ahead = prefetch_distance(blk);
    for_chunks(blk, L.row_len, [&](const auto& c) {
      prefetch(q, c, ahead);
      __m512 v[4];
      decode64(load_bytes(q, c), code, v);
      for (int j = 0; j < 4; ++j) v[j] = _mm512_mul_ps(v[j], a);
      using C = std::decay_t<decltype(c)>;
      if (stream && C::dense && ((reinterpret_cast<uintptr_t>(out + c.off[0]) |
                                  reinterpret_cast<uintptr_t>(out + c.off[1])) & 63) == 0) {
        // whole lines, 64 consecutive floats or a tile's two rows of 32
        for (int j = 0; j < 4; ++j) _mm512_stream_ps(out + c.off[j >> 1] + 16 * (j & 1), v[j]);
      } else {
        store_floats(out, c.off, c, v);
      }
    });
  }
}

namespace {

// What one AdamW8bit step holds in registers: both codes, their indexes, the coefficients.
struct StepRegs {
  Table256 code1, code2;
  IndexRegs r1, r2;
  Domain d1, d2;
  __m512 b1v, omb1, b2v, omb2, decay, step, isb, eps;
  StepRegs(const CodeLut& lut1, const CodeLut& lut2, const AdamWCoeffs& c)
      : code1(lut1.code_planes()), code2(lut2.code_planes()),
        r1(lut1), r2(lut2),
        d1(domain_of(*lut1.index())), d2(domain_of(*lut2.index())),
        b1v(_mm512_set1_ps(c.b1)), omb1(_mm512_set1_ps(c.one_minus_b1)),
        b2v(_mm512_set1_ps(c.b2)), omb2(_mm512_set1_ps(c.one_minus_b2)),
        decay(_mm512_set1_ps(c.decay)), step(_mm512_set1_ps(c.step_size)),
        isb(_mm512_set1_ps(c.inv_sqrt_bc2)), eps(_mm512_set1_ps(c.eps)) {}
};

// One chunk of the first half of the step: decode the moments (block absmax a1,
// a2), update them and the parameter (adamw_update's operations), keep the new
// moments in mbuf, vbuf at the chunk's buf; their max |.| into am1, am2.
template <class C>
inline void update_chunk(const StepRegs& R, float* p, const float* g, const uint8_t* q1,
                         const uint8_t* q2, __m512 a1, __m512 a2, const C& ch, int64_t ahead,
                         float* mbuf, float* vbuf, __m512& am1, __m512& am2) {
  prefetch(p, ch, ahead);
  prefetch(g, ch, ahead);
  prefetch(q1, ch, ahead);
  prefetch(q2, ch, ahead);
  __m512 m[4], v[4], gj[4], pj[4];
  decode64(load_bytes(q1, ch), R.code1, m);
  decode64(load_bytes(q2, ch), R.code2, v);
  load_floats(g, ch.off, ch, gj);
  load_floats(p, ch.off, ch, pj);
  for (int j = 0; j < 4; ++j) {
    // adamw_update's operations one by one, each rounded (no FMA): the portable bits
    const __m512 mj = _mm512_add_ps(_mm512_mul_ps(R.b1v, _mm512_mul_ps(m[j], a1)),
                                    _mm512_mul_ps(R.omb1, gj[j]));
    const __m512 vj = _mm512_add_ps(_mm512_mul_ps(R.b2v, _mm512_mul_ps(v[j], a2)),
                                    _mm512_mul_ps(_mm512_mul_ps(R.omb2, gj[j]), gj[j]));
    const __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vj), R.isb), R.eps);
    pj[j] = _mm512_sub_ps(_mm512_mul_ps(pj[j], R.decay),
                          _mm512_mul_ps(R.step, _mm512_div_ps(mj, denom)));
    am1 = _mm512_mask_max_ps(am1, ch.lane[j], am1, _mm512_abs_ps(mj));
    am2 = _mm512_mask_max_ps(am2, ch.lane[j], am2, _mm512_abs_ps(vj));
    m[j] = mj;
    v[j] = vj;
  }
  store_floats(p, ch.off, ch, pj);
  store_floats(mbuf, ch.buf, ch, m);
  store_floats(vbuf, ch.buf, ch, v);
}

// One chunk of the second half, for the dynamic maps (m folded, v non-negative):
// the codes of mbuf, vbuf (at the chunk's buf) times sc1, sc2. m by the index's
// shuffles, v by the table's gathers where they are in use, so the two overlap (on
// a Xeon, against both by either: the same or slower; cpu/gathers.h), else both by
// the index.
template <class C>
inline void encode_chunk(const StepRegs& R, const float* mbuf, const float* vbuf, const C& ch,
                         __m512 sc1, __m512 sc2, uint8_t* q1, uint8_t* q2) {
  __m512 m[4], v[4];
  load_floats(mbuf, ch.buf, ch, m);
  load_floats(vbuf, ch.buf, ch, v);
  for (int j = 0; j < 4; ++j) {
    m[j] = _mm512_mul_ps(m[j], sc1);
    v[j] = _mm512_mul_ps(v[j], sc2);
  }
  const __m512i c1 = encode64<Domain::kFolded>(m, R.r1);
  const __m512i c2 = R.r2.entry ? encode64_table(v, R.r2.entry, R.r2.code_mid)
                                : encode64<Domain::kNonNegative>(v, R.r2);
  store_bytes(q1, ch, c1);
  store_bytes(q2, ch, c2);
}

// The first half of one block's step, one pass: update_chunk over its chunks;
// the new moments' max |.| into *amax1, *amax2.
void update_block(const StepRegs& R, float* p, const float* g, const uint8_t* q1,
                  const uint8_t* q2, float absmax1, float absmax2, const BlockLayout::Block& blk,
                  int64_t row_len, float* mbuf, float* vbuf, float* amax1, float* amax2) {
  const __m512 a1 = _mm512_set1_ps(absmax1), a2 = _mm512_set1_ps(absmax2);
  __m512 am1 = _mm512_setzero_ps(), am2 = _mm512_setzero_ps();
  const int64_t ahead = prefetch_distance(blk);
  for_chunks(blk, row_len, [&](const auto& ch) {
    update_chunk(R, p, g, q1, q2, a1, a2, ch, ahead, mbuf, vbuf, am1, am2);
  });
  *amax1 = _mm512_reduce_max_ps(am1);
  *amax2 = _mm512_reduce_max_ps(am2);
}

bool dynamic_maps(const StepRegs& R) { return R.d1 == Domain::kFolded && R.d2 == Domain::kNonNegative; }

// The second half: the block's codes of mbuf, vbuf under absmax a1, a2.
void encode_block(const StepRegs& R, const float* mbuf, const float* vbuf,
                  const BlockLayout::Block& blk, int64_t row_len, float a1, float a2, uint8_t* q1,
                  uint8_t* q2) {
  const float s1 = scale_of(a1), s2 = scale_of(a2);
  if (dynamic_maps(R)) {  // one pass
    const __m512 sc1 = _mm512_set1_ps(s1), sc2 = _mm512_set1_ps(s2);
    for_chunks(blk, row_len, [&](const auto& ch) { encode_chunk(R, mbuf, vbuf, ch, sc1, sc2, q1, q2); });
  } else {
    quantize_block_in(R.d1, mbuf, true, blk, row_len, s1, R.r1, q1);
    quantize_block_in(R.d2, vbuf, true, blk, row_len, s2, R.r2, q2);
  }
}

// The software pipeline of adamw8bit_blocks over blocks b0, b0 + 1, ... while
// runs.regular(block) holds; returns the first block it did not take.
template <class Runs>
int64_t adamw8bit_pipelined(const StepRegs& R, float* p, const float* g, uint8_t* q1,
                            float* absmax1, uint8_t* q2, float* absmax2, const BlockLayout& L,
                            int64_t b0, int64_t b1, float* buf, const Runs& runs) {
  const int64_t w = L.max_block_elems();
  auto slot = [&](int64_t b) { return buf + (b & 1) * 2 * w; };
  float pa1 = 0.0f, pa2 = 0.0f;  // block b - 1's new absmax
  int64_t b = b0;
  for (; b < b1 && runs.regular(L.block(b)); ++b) {
    const auto blk = L.block(b);
    const auto before = b > b0 ? L.block(b - 1) : blk;
    const int64_t ahead = prefetch_distance(blk);
    float* mb = slot(b);
    const float* pm = slot(b - 1);
    const __m512 a1 = _mm512_set1_ps(absmax1[b]), a2 = _mm512_set1_ps(absmax2[b]);
    const __m512 sc1 = _mm512_set1_ps(scale_of(pa1)), sc2 = _mm512_set1_ps(scale_of(pa2));
    __m512 am1 = _mm512_setzero_ps(), am2 = _mm512_setzero_ps();
    for (int64_t i = 0; i < runs.chunks(); ++i) {
      update_chunk(R, p, g, q1, q2, a1, a2, runs.chunk(blk, i), ahead, mb, mb + w, am1, am2);
      if (b > b0) encode_chunk(R, pm, pm + w, runs.chunk(before, i), sc1, sc2, q1, q2);
    }
    if (b > b0) {
      absmax1[b - 1] = pa1;
      absmax2[b - 1] = pa2;
    }
    pa1 = _mm512_reduce_max_ps(am1);
    pa2 = _mm512_reduce_max_ps(am2);
  }
  if (b > b0) {  // the last pipelined block's codes
    const float* pm = slot(b - 1);
    encode_block(R, pm, pm + w, L.block(b - 1), L.row_len, pa1, pa2, q1, q2);
    absmax1[b - 1] = pa1;
    absmax2[b - 1] = pa2;
  }
  return b;
}

}  // namespace

// Where the maps are the dynamic ones and the blocks regular (RowRuns, TilePairs),
// the step runs software-pipelined: chunk i of block b's update beside chunk i of
// block b - 1's encode. The update waits on the divider (sqrt and division: 88
// cycles a 64-element chunk, llvm-mca), the encode on shuffles and gathers; one
// block after the other they add, side by side they overlap (4 Mi, B = 256: 1.10
// -> 0.95 ns a parameter). buf: two blocks of moments (4 x max_block_elems).
void adamw8bit_blocks(float* p, const float* g, uint8_t* q1, float* absmax1, uint8_t* q2,
                      float* absmax2, const BlockLayout& L, const CodeLut& lut1,
                      const CodeLut& lut2, const AdamWCoeffs& c, int64_t b0, int64_t b1,
                      float* buf) {
  const StepRegs R(lut1, lut2, c);
  const int64_t w = L.max_block_elems(), row_len = L.row_len;
  auto one_block = [&](int64_t b) {
    const auto blk = L.block(b);
    float amax1, amax2;
    update_block(R, p, g, q1, q2, absmax1[b], absmax2[b], blk, row_len, buf, buf + w, &amax1,
                 &amax2);
    encode_block(R, buf, buf + w, blk, row_len, amax1, amax2, q1, q2);
    absmax1[b] = amax1;
    absmax2[b] = amax2;
  };
  if (!dynamic_maps(R)) {
    for (int64_t b = b0; b < b1; ++b) one_block(b);
    return;
  }
  // runs of regular blocks pipelined, the others (a short last block, a tile
  // row's partial last tile) one at a time
  auto run = [&](const auto& runs) {
    for (int64_t b = b0; b < b1;) {
      b = adamw8bit_pipelined(R, p, g, q1, absmax1, q2, absmax2, L, b, b1, buf, runs);
      for (; b < b1 && !runs.regular(L.block(b)); ++b) one_block(b);
    }
  };
  if (!L.shape.is_tile() && w % 64 == 0) {
    run(RowRuns{w});
  } else if (L.shape.tile_rows == 32 && L.shape.tile_cols == 32) {
    run(TilePairs{row_len});
  } else {
    for (int64_t b = b0; b < b1; ++b) one_block(b);
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
  const StepRegs R(lut1, lut2, AdamWCoeffs{});
  const int64_t w = L.max_block_elems();
  for (int64_t b = b0; b < b1; ++b) {
    encode_block(R, scratch + 2 * b * w, scratch + (2 * b + 1) * w, L.block(b), L.row_len,
                 agreed1[b], agreed2[b], q1, q2);
    absmax1[b] = agreed1[b];
    absmax2[b] = agreed2[b];
  }
}

namespace {

// torch.lerp's float arithmetic (cpu/portable.cpp's torch_lerp) for a
// scalar weight w whose branch (|w| < 0.5) the caller chose: small ? a + w (b - a)
// : b - (b - a)(1 - w), each operation rounded.
inline __m512 torch_lerp(__m512 a, __m512 b, bool small, __m512 w, __m512 one_minus_w) {
  const __m512 d = _mm512_sub_ps(b, a);
  return small ? _mm512_add_ps(a, _mm512_mul_ps(w, d)) : _mm512_sub_ps(b, _mm512_mul_ps(d, one_minus_w));
}

}  // namespace

void momentum8bit_blocks(const float* g, const uint8_t* q, const float* absmax, const BlockLayout& L,
                         const CodeLut& lut, float beta, bool nesterov, uint8_t* q_out,
                         float* absmax_out, float* u, int64_t b0, int64_t b1, float* mbuf,
                         bool* bad) {
  const Table256 code(lut.code_planes());
  const IndexRegs r(lut);
  const Domain d = domain_of(*lut.index());
  const float w = 1.0f - beta;
  const bool small_w = std::fabs(w) < 0.5f, small_beta = std::fabs(beta) < 0.5f;
  const __m512 wv = _mm512_set1_ps(w), omw = _mm512_set1_ps(1.0f - w);
  const __m512 bv = _mm512_set1_ps(beta), omb = _mm512_set1_ps(1.0f - beta);
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
  for (int64_t b = b0; b < b1; ++b) {
    const auto blk = L.block(b);
    const __m512 a = _mm512_set1_ps(absmax[b]);
    __m512i am = _mm512_setzero_si512();  // max |m| as bits (block_absmax's rule)
    const int64_t ahead = prefetch_distance(blk);
    for_chunks(blk, L.row_len, [&](const auto& ch) {
      prefetch(g, ch, ahead);
      prefetch(q, ch, ahead);
      __m512 m[4], gj[4], uj[4];
      decode64(load_bytes(q, ch), code, m);
      load_floats(g, ch.off, ch, gj);
      for (int j = 0; j < 4; ++j) {
        m[j] = torch_lerp(_mm512_mul_ps(m[j], a), gj[j], small_w, wv, omw);
        uj[j] = nesterov ? torch_lerp(gj[j], m[j], small_beta, bv, omb) : m[j];
        am = _mm512_mask_max_epu32(am, ch.lane[j], am,
                                   _mm512_and_si512(_mm512_castps_si512(m[j]), magnitude));
      }
      store_floats(u, ch.off, ch, uj);
      store_floats(mbuf, ch.buf, ch, m);
    });
    const float amax = absmax_of_bits(_mm512_reduce_max_epu32(am), bad);
    quantize_block_in(d, mbuf, true, blk, L.row_len, scale_of(amax), r, q_out);
    absmax_out[b] = amax;
  }
}

}  // namespace rfsdp::quant::cpu::avx512

#pragma GCC pop_options

#else  // not x86-64 GCC: supported() is false, so nothing below is reached

#include <stdexcept>

namespace rfsdp::quant::cpu::avx512 {
namespace {
[[noreturn]] void absent() { throw std::logic_error("the AVX-512 quantisation kernels are not built here"); }
}  // namespace
bool supported() { return false; }
void quantize_blocks(const float*, const BlockLayout&, const CodeLut&, uint8_t*, float*, int64_t,
                     int64_t, bool*) { absent(); }
void dequantize_blocks(const uint8_t*, const float*, const BlockLayout&, const CodeLut&, float*,
                       int64_t, int64_t) { absent(); }
void adamw8bit_blocks(float*, const float*, uint8_t*, float*, uint8_t*, float*,
                      const BlockLayout&, const CodeLut&, const CodeLut&, const AdamWCoeffs&,
                      int64_t, int64_t, float*) { absent(); }
void adamw8bit_begin_blocks(float*, const float*, const uint8_t*, const float*, const uint8_t*,
                            const float*, const BlockLayout&, const CodeLut&, const CodeLut&,
                            const AdamWCoeffs&, int64_t, int64_t, float*, float*, float*) {
  absent();
}
void adamw8bit_end_blocks(const float*, const BlockLayout&, const CodeLut&, const CodeLut&,
                          const float*, const float*, uint8_t*, float*, uint8_t*, float*, int64_t,
                          int64_t) {
  absent();
}
void momentum8bit_blocks(const float*, const uint8_t*, const float*, const BlockLayout&,
                         const CodeLut&, float, bool, uint8_t*, float*, float*, int64_t, int64_t,
                         float*, bool*) {
  absent();
}
}  // namespace rfsdp::quant::cpu::avx512

#endif
