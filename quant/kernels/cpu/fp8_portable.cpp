// The portable kernels of the float8_e4m3fn format (cpu/fp8.h): scalar loops
// over formats/fp8_e4m3.h, the reference the vector sets are held to.
#include <cmath>

#include "quant/formats/absmax_bits.h"
#include "quant/formats/fp8_e4m3.h"
#include "quant/kernels/cpu/fp8.h"

namespace rfsdp::quant::cpu::portable {

namespace {

// Max |x| over n values by magnitude bits (absmax_bits.h: Inf and NaN above every finite value).
uint32_t max_bits(const float* x, int64_t n, uint32_t acc) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = magnitude_bits(x[i]);
    acc = acc < b ? b : acc;
  }
  return acc;
}

void encode_run(const float* x, float r, bool keep_nonzero, int64_t n, uint8_t* q) {
  for (int64_t i = 0; i < n; ++i) q[i] = fp8::encode(x[i] * r, keep_nonzero);
}

void quantize(const float* x, const BlockLayout& L, bool keep_nonzero, uint8_t* q, float* absmax,
              int64_t b0, int64_t b1, bool* bad) {
  for (int64_t b = b0; b < b1; ++b) {
    const auto blk = L.block(b);
    uint32_t mb = 0;
    for (int64_t s = 0; s < blk.segments; ++s) mb = max_bits(x + blk.start + s * L.row_len, blk.seg_len, mb);
    const float amax = absmax_of_bits(mb, bad);
    const float r = fp8::encode_scale(amax);
    for (int64_t s = 0; s < blk.segments; ++s) {
      const int64_t off = blk.start + s * L.row_len;
      encode_run(x + off, r, keep_nonzero, blk.seg_len, q + off);
    }
    absmax[b] = amax;
  }
}

void dequantize(const uint8_t* q, const float* absmax, const BlockLayout& L, float* out,
                int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const auto blk = L.block(b);
    const float s = fp8::decode_scale(absmax[b]);
    for (int64_t seg = 0; seg < blk.segments; ++seg) {
      const int64_t off = blk.start + seg * L.row_len;
      for (int64_t i = 0; i < blk.seg_len; ++i) out[off + i] = fp8::decode(q[off + i]) * s;
    }
  }
}

// The first half of a block's step: decode, update the parameter and the
// moments (into mbuf, vbuf, the block's elements segment after segment); the
// new moments' max |.| into *amax1, *amax2.
void update_block(float* p, const float* g, const uint8_t* q1, const uint8_t* q2, float a1,
                  float a2, const BlockLayout& L, const BlockLayout::Block& blk,
                  const AdamWCoeffs& c, float* mbuf, float* vbuf, float* amax1, float* amax2) {
  const float s1 = fp8::decode_scale(a1), s2 = fp8::decode_scale(a2);
  for (int64_t seg = 0; seg < blk.segments; ++seg) {
    const int64_t off = blk.start + seg * L.row_len, k = seg * blk.seg_len;
    for (int64_t i = 0; i < blk.seg_len; ++i) {
      float m = fp8::decode(q1[off + i]) * s1, v = fp8::decode(q2[off + i]) * s2;
      adamw_update(p[off + i], m, v, g[off + i], c);
      mbuf[k + i] = m;
      vbuf[k + i] = v;
    }
  }
  bool unused = false;
  *amax1 = absmax_of_bits(max_bits(mbuf, blk.count, 0), &unused);
  *amax2 = absmax_of_bits(max_bits(vbuf, blk.count, 0), &unused);
}

// The second half: the block's codes of mbuf, vbuf under absmax a1, a2.
void encode_block(const float* mbuf, const float* vbuf, const BlockLayout& L,
                  const BlockLayout::Block& blk, float a1, float a2, uint8_t* q1, uint8_t* q2) {
  const float r1 = fp8::encode_scale(a1), r2 = fp8::encode_scale(a2);
  for (int64_t seg = 0; seg < blk.segments; ++seg) {
    const int64_t off = blk.start + seg * L.row_len, k = seg * blk.seg_len;
    encode_run(mbuf + k, r1, false, blk.seg_len, q1 + off);
    encode_run(vbuf + k, r2, true, blk.seg_len, q2 + off);
  }
}

void adamw(float* p, const float* g, uint8_t* q1, float* absmax1, uint8_t* q2, float* absmax2,
           const BlockLayout& L, const AdamWCoeffs& c, int64_t b0, int64_t b1, float* mbuf,
           float* vbuf) {
  for (int64_t b = b0; b < b1; ++b) {
    const auto blk = L.block(b);
    float amax1, amax2;
    update_block(p, g, q1, q2, absmax1[b], absmax2[b], L, blk, c, mbuf, vbuf, &amax1, &amax2);
    encode_block(mbuf, vbuf, L, blk, amax1, amax2, q1, q2);
    absmax1[b] = amax1;
    absmax2[b] = amax2;
  }
}

void adamw_begin(float* p, const float* g, const uint8_t* q1, const float* absmax1,
                 const uint8_t* q2, const float* absmax2, const BlockLayout& L,
                 const AdamWCoeffs& c, int64_t b0, int64_t b1, float* scratch, float* amax1,
                 float* amax2) {
  const int64_t w = L.max_block_elems();
  for (int64_t b = b0; b < b1; ++b) {
    update_block(p, g, q1, q2, absmax1[b], absmax2[b], L, L.block(b), c, scratch + 2 * b * w,
                 scratch + (2 * b + 1) * w, amax1 + b, amax2 + b);
  }
}

void adamw_end(const float* scratch, const BlockLayout& L, const float* agreed1,
               const float* agreed2, uint8_t* q1, float* absmax1, uint8_t* q2, float* absmax2,
               int64_t b0, int64_t b1) {
  const int64_t w = L.max_block_elems();
  for (int64_t b = b0; b < b1; ++b) {
    encode_block(scratch + 2 * b * w, scratch + (2 * b + 1) * w, L, L.block(b), agreed1[b],
                 agreed2[b], q1, q2);
    absmax1[b] = agreed1[b];
    absmax2[b] = agreed2[b];
  }
}

// torch.lerp's float arithmetic, as cpu/portable.cpp's torch_lerp.
inline float torch_lerp(float a, float b, float w) {
  return std::fabs(w) < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w);
}

void momentum(const float* g, const uint8_t* q, const float* absmax, const BlockLayout& L,
              float beta, bool nesterov, uint8_t* q_out, float* absmax_out, float* u, int64_t b0,
              int64_t b1, float* mbuf, bool* bad) {
  const float w = 1.0f - beta;
  for (int64_t b = b0; b < b1; ++b) {
    const auto blk = L.block(b);
    const float s = fp8::decode_scale(absmax[b]);
    for (int64_t seg = 0; seg < blk.segments; ++seg) {
      const int64_t off = blk.start + seg * L.row_len, k = seg * blk.seg_len;
      for (int64_t i = 0; i < blk.seg_len; ++i) {
        const float m = torch_lerp(fp8::decode(q[off + i]) * s, g[off + i], w);
        mbuf[k + i] = m;
        u[off + i] = nesterov ? torch_lerp(g[off + i], m, beta) : m;
      }
    }
    const float amax = absmax_of_bits(max_bits(mbuf, blk.count, 0), bad);
    const float r = fp8::encode_scale(amax);
    for (int64_t seg = 0; seg < blk.segments; ++seg) {
      encode_run(mbuf + seg * blk.seg_len, r, false, blk.seg_len, q_out + blk.start + seg * L.row_len);
    }
    absmax_out[b] = amax;
  }
}

}  // namespace

const Fp8Kernels& fp8_kernels() {
  static const Fp8Kernels k{quantize, dequantize, adamw, adamw_begin, adamw_end, momentum};
  return k;
}

}  // namespace rfsdp::quant::cpu::portable
