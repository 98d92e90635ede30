#include "quant/kernels/cuda/kernels.h"

#include <cmath>
#include <type_traits>

#include "quant/formats/fp8_e4m3.h"

namespace rfsdp::quant::cuda {

namespace {

constexpr int kThreads = 256;
// Elements a thread holds in registers: the kernels are instantiated for 1, 2, 4,
// 8 and 16 (4096-element blocks) and launched with the fewest that cover the
// layout's largest block, so 256-element blocks keep registers (and occupancy,
// hence bytes in flight) for one element per thread, not sixteen.
template <class F>
void with_items(int64_t max_block_elems, F&& launch) {
  if (max_block_elems <= kThreads) return launch(std::integral_constant<int, 1>{});
  if (max_block_elems <= 2 * kThreads) return launch(std::integral_constant<int, 2>{});
  if (max_block_elems <= 4 * kThreads) return launch(std::integral_constant<int, 4>{});
  if (max_block_elems <= 8 * kThreads) return launch(std::integral_constant<int, 8>{});
  return launch(std::integral_constant<int, kMaxBlockElems / kThreads>{});
}

// The nearest code (ties to the lower) in shared memory: the midpoints, and the
// code's arithmetic index when it has one. CodeIndex has default member
// initialisers, so it sits in raw shared storage.
struct SharedCode {
  float mid[256];
  alignas(CodeIndex) unsigned char index[sizeof(CodeIndex)];
  bool has_index;

  // All threads of the block; the caller synchronises before use.
  __device__ void load(const float* code, const CodeIndex& ix, bool has, bool keep_nonzero) {
    const int i = threadIdx.x;  // kThreads == 256
    mid[i] = code_midpoint(code, i, keep_nonzero);  // as CodeLut does
    const unsigned char* src = reinterpret_cast<const unsigned char*>(&ix);
    for (int b = i; b < static_cast<int>(sizeof(CodeIndex)); b += blockDim.x) index[b] = src[b];
    if (i == 0) has_index = has;
  }
  __device__ uint8_t nearest(float v) const {
    if (has_index) return static_cast<uint8_t>(reinterpret_cast<const CodeIndex*>(index)->nearest(v, mid));
    int lo = 0, hi = 255;  // smallest i with v <= mid[i]
    while (lo < hi) {
      const int m = (lo + hi) >> 1;
      if (v <= mid[m]) hi = m; else lo = m + 1;
    }
    return static_cast<uint8_t>(lo);
  }
};

// A kernel argument: the index by value (zeroed when absent).
struct IndexArg {
  CodeIndex ix;
  bool has;
  bool keep_nonzero;
};
IndexArg index_arg(CodeRounding r) {
  IndexArg a{};
  if (r.index) a.ix = *r.index;
  a.has = r.index != nullptr;
  a.keep_nonzero = r.keep_nonzero;
  return a;
}

// Element k of a block (0 <= k < count <= 4096) -> its offset in the tensor. One
// segment (1-D blocks): contiguous; tiles: 32-bit division (64-bit division is a
// long software sequence on GPUs).
__device__ inline int64_t element(const BlockLayout::Block& b, int64_t row_len, int k) {
  const int seg = static_cast<int>(b.seg_len);
  if (b.segments == 1) return b.start + k;
  return b.start + static_cast<int64_t>(k / seg) * row_len + (k % seg);
}

__device__ inline float block_max(float v, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (kThreads >> 5) ? scratch[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) scratch[0] = v;
  }
  __syncthreads();
  const float r = scratch[0];
  __syncthreads();
  return r;
}

// Every kernel walks the quantisation blocks grid-stride, a thread block taking
// one block at a time: the code tables are loaded into shared memory once per
// thread block, not once per 1 KiB quantisation block.
template <int kItems>
__global__ void quantize_kernel(const float* __restrict x, BlockLayout L,
                                const float* __restrict code_g, IndexArg ia,
                                uint8_t* __restrict q, float* __restrict absmax) {
  __shared__ SharedCode code;
  __shared__ float scratch[32];
  code.load(code_g, ia.ix, ia.has, ia.keep_nonzero);
  __syncthreads();
  for (int64_t blk = blockIdx.x; blk < L.num_blocks; blk += gridDim.x) {
    const BlockLayout::Block b = L.block(blk);
    const int count = static_cast<int>(b.count);
    float v[kItems];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int k = threadIdx.x + i * kThreads;
      v[i] = k < count ? x[element(b, L.row_len, k)] : 0.0f;
      amax = fmaxf(amax, fabsf(v[i]));
    }
    amax = block_max(amax, scratch);
    const float scale = amax > 0.0f ? 1.0f / amax : 0.0f;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int k = threadIdx.x + i * kThreads;
      if (k < count) q[element(b, L.row_len, k)] = code.nearest(v[i] * scale);
    }
    if (threadIdx.x == 0) absmax[blk] = amax;
  }
}

__global__ void dequantize_kernel(const uint8_t* __restrict q, const float* __restrict absmax,
                                  BlockLayout L, const float* __restrict code_g,
                                  float* __restrict out) {
  __shared__ float code[256];
  code[threadIdx.x] = code_g[threadIdx.x];
  __syncthreads();
  for (int64_t blk = blockIdx.x; blk < L.num_blocks; blk += gridDim.x) {
    const BlockLayout::Block b = L.block(blk);
    const int count = static_cast<int>(b.count);
    const float a = absmax[blk];
    for (int k = threadIdx.x; k < count; k += kThreads) {
      const int64_t e = element(b, L.row_len, k);
      out[e] = code[q[e]] * a;
    }
  }
}

template <int kItems>
__global__ void adamw8bit_kernel(float* __restrict p, const float* __restrict g,
                                 uint8_t* __restrict q1, float* __restrict absmax1,
                                 uint8_t* __restrict q2, float* __restrict absmax2, BlockLayout L,
                                 const float* __restrict code1_g, IndexArg ia1,
                                 const float* __restrict code2_g, IndexArg ia2, AdamWCoeffs c) {
  __shared__ float code1[256], code2[256];
  __shared__ SharedCode near1, near2;
  __shared__ float scratch[32];
  code1[threadIdx.x] = code1_g[threadIdx.x];
  code2[threadIdx.x] = code2_g[threadIdx.x];
  near1.load(code1_g, ia1.ix, ia1.has, ia1.keep_nonzero);
  near2.load(code2_g, ia2.ix, ia2.has, ia2.keep_nonzero);
  __syncthreads();
  for (int64_t blk = blockIdx.x; blk < L.num_blocks; blk += gridDim.x) {
    const BlockLayout::Block b = L.block(blk);
    const int count = static_cast<int>(b.count);
    const float a1 = absmax1[blk], a2 = absmax2[blk];
    float m[kItems], v[kItems];
    float amax1 = 0.0f, amax2 = 0.0f;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int k = threadIdx.x + i * kThreads;
      m[i] = v[i] = 0.0f;
      if (k < count) {
        const int64_t e = element(b, L.row_len, k);
        m[i] = code1[q1[e]] * a1;
        v[i] = code2[q2[e]] * a2;
        float pe = p[e];
        adamw_update(pe, m[i], v[i], g[e], c);
        p[e] = pe;
        amax1 = fmaxf(amax1, fabsf(m[i]));
        amax2 = fmaxf(amax2, v[i]);
      }
    }
    // Every thread read this block's absmax above; block_max's barriers order
    // those reads before thread 0 writes the new ones below.
    amax1 = block_max(amax1, scratch);
    amax2 = block_max(amax2, scratch);
    const float s1 = amax1 > 0.0f ? 1.0f / amax1 : 0.0f;
    const float s2 = amax2 > 0.0f ? 1.0f / amax2 : 0.0f;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int k = threadIdx.x + i * kThreads;
      if (k < count) {
        const int64_t e = element(b, L.row_len, k);
        q1[e] = near1.nearest(m[i] * s1);
        q2[e] = near2.nearest(v[i] * s2);
      }
    }
    if (threadIdx.x == 0) {
      absmax1[blk] = amax1;
      absmax2[blk] = amax2;
    }
  }
}

// The step of blocks that ranks share, in two halves around the agreement of each
// block's absmax (cpu/kernels.h adamw8bit_begin / _end): begin updates the
// parameter, keeps the new moments in scratch (block b's m at 2 b w, its v at
// (2 b + 1) w, w = L.max_block_elems(), as the CPU kernels keep them) and this
// rank's max |.| per block in amax1, amax2; end writes the codes under the agreed
// absmax and stores it.
template <int kItems>
__global__ void adamw8bit_begin_kernel(float* __restrict p, const float* __restrict g,
                                       const uint8_t* __restrict q1, const float* __restrict absmax1,
                                       const uint8_t* __restrict q2, const float* __restrict absmax2,
                                       BlockLayout L, const float* __restrict code1_g,
                                       const float* __restrict code2_g, AdamWCoeffs c,
                                       float* __restrict scratch, float* __restrict amax1_out,
                                       float* __restrict amax2_out) {
  __shared__ float code1[256], code2[256];
  __shared__ float scratch_max[32];
  code1[threadIdx.x] = code1_g[threadIdx.x];
  code2[threadIdx.x] = code2_g[threadIdx.x];
  __syncthreads();
  const int64_t w = L.max_block_elems();
  for (int64_t blk = blockIdx.x; blk < L.num_blocks; blk += gridDim.x) {
    const BlockLayout::Block b = L.block(blk);
    const int count = static_cast<int>(b.count);
    const float a1 = absmax1[blk], a2 = absmax2[blk];
    float amax1 = 0.0f, amax2 = 0.0f;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int k = threadIdx.x + i * kThreads;
      if (k < count) {
        const int64_t e = element(b, L.row_len, k);
        float m = code1[q1[e]] * a1, v = code2[q2[e]] * a2, pe = p[e];
        adamw_update(pe, m, v, g[e], c);
        p[e] = pe;
        scratch[2 * blk * w + k] = m;
        scratch[(2 * blk + 1) * w + k] = v;
        amax1 = fmaxf(amax1, fabsf(m));
        amax2 = fmaxf(amax2, v);
      }
    }
    amax1 = block_max(amax1, scratch_max);
    amax2 = block_max(amax2, scratch_max);
    if (threadIdx.x == 0) {
      amax1_out[blk] = amax1;
      amax2_out[blk] = amax2;
    }
  }
}

template <int kItems>
__global__ void adamw8bit_end_kernel(const float* __restrict scratch, BlockLayout L,
                                     const float* __restrict code1_g, IndexArg ia1,
                                     const float* __restrict code2_g, IndexArg ia2,
                                     const float* __restrict agreed1, const float* __restrict agreed2,
                                     uint8_t* __restrict q1, float* __restrict absmax1,
                                     uint8_t* __restrict q2, float* __restrict absmax2) {
  __shared__ SharedCode near1, near2;
  near1.load(code1_g, ia1.ix, ia1.has, ia1.keep_nonzero);
  near2.load(code2_g, ia2.ix, ia2.has, ia2.keep_nonzero);
  __syncthreads();
  const int64_t w = L.max_block_elems();
  for (int64_t blk = blockIdx.x; blk < L.num_blocks; blk += gridDim.x) {
    const BlockLayout::Block b = L.block(blk);
    const int count = static_cast<int>(b.count);
    const float a1 = agreed1[blk], a2 = agreed2[blk];
    const float s1 = a1 > 0.0f ? 1.0f / a1 : 0.0f;
    const float s2 = a2 > 0.0f ? 1.0f / a2 : 0.0f;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int k = threadIdx.x + i * kThreads;
      if (k < count) {
        const int64_t e = element(b, L.row_len, k);
        q1[e] = near1.nearest(scratch[2 * blk * w + k] * s1);
        q2[e] = near2.nearest(scratch[(2 * blk + 1) * w + k] * s2);
      }
    }
    if (threadIdx.x == 0) {
      absmax1[blk] = a1;
      absmax2[blk] = a2;
    }
  }
}

// The float8_e4m3fn format (formats/fp8_e4m3.h): codes by arithmetic, no
// shared table; otherwise as the kernels above (one quantisation block per
// thread block, the same element order and block maxima).
template <int kItems>
__global__ void quantize_fp8_kernel(const float* __restrict x, BlockLayout L, bool keep_nonzero,
                                    uint8_t* __restrict q, float* __restrict absmax) {
  __shared__ float scratch[32];
  for (int64_t blk = blockIdx.x; blk < L.num_blocks; blk += gridDim.x) {
    const BlockLayout::Block b = L.block(blk);
    const int count = static_cast<int>(b.count);
    float v[kItems];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int k = threadIdx.x + i * kThreads;
      v[i] = k < count ? x[element(b, L.row_len, k)] : 0.0f;
      amax = fmaxf(amax, fabsf(v[i]));
    }
    amax = block_max(amax, scratch);
    const float r = fp8::encode_scale(amax);
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int k = threadIdx.x + i * kThreads;
      if (k < count) q[element(b, L.row_len, k)] = fp8::encode(__fmul_rn(v[i], r), keep_nonzero);
    }
    if (threadIdx.x == 0) absmax[blk] = amax;
  }
}

__global__ void dequantize_fp8_kernel(const uint8_t* __restrict q, const float* __restrict absmax,
                                      BlockLayout L, float* __restrict out) {
  for (int64_t blk = blockIdx.x; blk < L.num_blocks; blk += gridDim.x) {
    const BlockLayout::Block b = L.block(blk);
    const int count = static_cast<int>(b.count);
    const float s = fp8::decode_scale(absmax[blk]);
    for (int k = threadIdx.x; k < count; k += kThreads) {
      const int64_t e = element(b, L.row_len, k);
      out[e] = __fmul_rn(fp8::decode(q[e]), s);
    }
  }
}

// The fused step (whole blocks: agreed null) or its first half (cut blocks:
// the new moments into scratch, this rank's maxima into amax1_out, amax2_out);
// adamw_fp8_end_kernel is the second half.
template <int kItems>
__global__ void adamw_fp8_kernel(float* __restrict p, const float* __restrict g,
                                 uint8_t* __restrict q1, float* __restrict absmax1,
                                 uint8_t* __restrict q2, float* __restrict absmax2, BlockLayout L,
                                 AdamWCoeffs c, float* __restrict scratch,
                                 float* __restrict amax1_out, float* __restrict amax2_out) {
  __shared__ float scratch_max[32];
  const int64_t w = L.max_block_elems();
  for (int64_t blk = blockIdx.x; blk < L.num_blocks; blk += gridDim.x) {
    const BlockLayout::Block b = L.block(blk);
    const int count = static_cast<int>(b.count);
    const float s1 = fp8::decode_scale(absmax1[blk]), s2 = fp8::decode_scale(absmax2[blk]);
    float m[kItems], v[kItems];
    float amax1 = 0.0f, amax2 = 0.0f;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int k = threadIdx.x + i * kThreads;
      m[i] = v[i] = 0.0f;
      if (k < count) {
        const int64_t e = element(b, L.row_len, k);
        m[i] = __fmul_rn(fp8::decode(q1[e]), s1);
        v[i] = __fmul_rn(fp8::decode(q2[e]), s2);
        float pe = p[e];
        adamw_update(pe, m[i], v[i], g[e], c);
        p[e] = pe;
        if (scratch) {
          scratch[2 * blk * w + k] = m[i];
          scratch[(2 * blk + 1) * w + k] = v[i];
        }
        amax1 = fmaxf(amax1, fabsf(m[i]));
        amax2 = fmaxf(amax2, v[i]);
      }
    }
    // Every thread read this block's absmax above; block_max's barriers order
    // those reads before thread 0 writes the new ones below.
    amax1 = block_max(amax1, scratch_max);
    amax2 = block_max(amax2, scratch_max);
    if (scratch) {
      if (threadIdx.x == 0) {
        amax1_out[blk] = amax1;
        amax2_out[blk] = amax2;
      }
      continue;
    }
    const float r1 = fp8::encode_scale(amax1), r2 = fp8::encode_scale(amax2);
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int k = threadIdx.x + i * kThreads;
      if (k < count) {
        const int64_t e = element(b, L.row_len, k);
        q1[e] = fp8::encode(__fmul_rn(m[i], r1), false);
        q2[e] = fp8::encode(__fmul_rn(v[i], r2), true);
      }
    }
    if (threadIdx.x == 0) {
      absmax1[blk] = amax1;
      absmax2[blk] = amax2;
    }
  }
}

__global__ void adamw_fp8_end_kernel(const float* __restrict scratch, BlockLayout L,
                                     const float* __restrict agreed1,
                                     const float* __restrict agreed2, uint8_t* __restrict q1,
                                     float* __restrict absmax1, uint8_t* __restrict q2,
                                     float* __restrict absmax2) {
  const int64_t w = L.max_block_elems();
  for (int64_t blk = blockIdx.x; blk < L.num_blocks; blk += gridDim.x) {
    const BlockLayout::Block b = L.block(blk);
    const int count = static_cast<int>(b.count);
    const float a1 = agreed1[blk], a2 = agreed2[blk];
    const float r1 = fp8::encode_scale(a1), r2 = fp8::encode_scale(a2);
    for (int k = threadIdx.x; k < count; k += kThreads) {
      const int64_t e = element(b, L.row_len, k);
      q1[e] = fp8::encode(__fmul_rn(scratch[2 * blk * w + k], r1), false);
      q2[e] = fp8::encode(__fmul_rn(scratch[(2 * blk + 1) * w + k], r2), true);
    }
    if (threadIdx.x == 0) {
      absmax1[blk] = a1;
      absmax2[blk] = a2;
    }
  }
}

// Thread blocks to launch: enough to fill the GPU a few times over (8 resident
// blocks of 256 threads per multiprocessor), never more than there are
// quantisation blocks.
unsigned grid_for(const BlockLayout& L) {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms < 1) {
    sms = 132;
  }
  const int64_t most = static_cast<int64_t>(sms) * 8 * 4;
  return static_cast<unsigned>(L.num_blocks < most ? L.num_blocks : most);
}

cudaError_t check_layout(const BlockLayout& L) {
  if (L.max_block_elems() > kMaxBlockElems || L.num_blocks > 0x7fffffff) return cudaErrorInvalidValue;
  return cudaSuccess;
}

}  // namespace

cudaError_t quantize(const float* x, const BlockLayout& L, const float* code,
                     CodeRounding rounding, uint8_t* q, float* absmax, cudaStream_t stream) {
  if (cudaError_t e = check_layout(L); e != cudaSuccess) return e;
  if (L.num_blocks == 0) return cudaSuccess;
  with_items(L.max_block_elems(), [&](auto items) {
    quantize_kernel<decltype(items)::value><<<grid_for(L), kThreads, 0, stream>>>(
        x, L, code, index_arg(rounding), q, absmax);
  });
  return cudaGetLastError();
}

cudaError_t dequantize(const uint8_t* q, const float* absmax, const BlockLayout& L,
                       const float* code, float* out, cudaStream_t stream) {
  if (cudaError_t e = check_layout(L); e != cudaSuccess) return e;
  if (L.num_blocks == 0) return cudaSuccess;
  dequantize_kernel<<<grid_for(L), kThreads, 0, stream>>>(q, absmax, L, code, out);
  return cudaGetLastError();
}

cudaError_t adamw8bit_step(float* param, const float* grad, uint8_t* q1, float* absmax1,
                           uint8_t* q2, float* absmax2, const BlockLayout& L, const float* code1,
                           CodeRounding rounding1, const float* code2, CodeRounding rounding2,
                           const AdamWHyper& h, cudaStream_t stream) {
  if (cudaError_t e = check_layout(L); e != cudaSuccess) return e;
  if (L.num_blocks == 0) return cudaSuccess;
  const AdamWCoeffs c = adamw_coeffs(h);
  with_items(L.max_block_elems(), [&](auto items) {
    adamw8bit_kernel<decltype(items)::value><<<grid_for(L), kThreads, 0, stream>>>(
        param, grad, q1, absmax1, q2, absmax2, L, code1, index_arg(rounding1), code2,
        index_arg(rounding2), c);
  });
  return cudaGetLastError();
}

cudaError_t adamw8bit_begin(float* param, const float* grad, const uint8_t* q1,
                            const float* absmax1, const uint8_t* q2, const float* absmax2,
                            const BlockLayout& L, const float* code1, const float* code2,
                            const AdamWHyper& h, float* scratch, float* amax1, float* amax2,
                            cudaStream_t stream) {
  if (cudaError_t e = check_layout(L); e != cudaSuccess) return e;
  if (L.num_blocks == 0) return cudaSuccess;
  const AdamWCoeffs c = adamw_coeffs(h);
  with_items(L.max_block_elems(), [&](auto items) {
    adamw8bit_begin_kernel<decltype(items)::value><<<grid_for(L), kThreads, 0, stream>>>(
        param, grad, q1, absmax1, q2, absmax2, L, code1, code2, c, scratch, amax1, amax2);
  });
  return cudaGetLastError();
}

cudaError_t adamw8bit_end(const float* scratch, const BlockLayout& L, const float* code1,
                          CodeRounding rounding1, const float* code2, CodeRounding rounding2,
                          const float* agreed1, const float* agreed2, uint8_t* q1, float* absmax1,
                          uint8_t* q2, float* absmax2, cudaStream_t stream) {
  if (cudaError_t e = check_layout(L); e != cudaSuccess) return e;
  if (L.num_blocks == 0) return cudaSuccess;
  with_items(L.max_block_elems(), [&](auto items) {
    adamw8bit_end_kernel<decltype(items)::value><<<grid_for(L), kThreads, 0, stream>>>(
        scratch, L, code1, index_arg(rounding1), code2, index_arg(rounding2), agreed1, agreed2,
        q1, absmax1, q2, absmax2);
  });
  return cudaGetLastError();
}

cudaError_t quantize_fp8(const float* x, const BlockLayout& L, bool keep_nonzero, uint8_t* q,
                         float* absmax, cudaStream_t stream) {
  if (cudaError_t e = check_layout(L); e != cudaSuccess) return e;
  if (L.num_blocks == 0) return cudaSuccess;
  with_items(L.max_block_elems(), [&](auto items) {
    quantize_fp8_kernel<decltype(items)::value><<<grid_for(L), kThreads, 0, stream>>>(
        x, L, keep_nonzero, q, absmax);
  });
  return cudaGetLastError();
}

cudaError_t dequantize_fp8(const uint8_t* q, const float* absmax, const BlockLayout& L,
                           float* out, cudaStream_t stream) {
  if (cudaError_t e = check_layout(L); e != cudaSuccess) return e;
  if (L.num_blocks == 0) return cudaSuccess;
  dequantize_fp8_kernel<<<grid_for(L), kThreads, 0, stream>>>(q, absmax, L, out);
  return cudaGetLastError();
}

cudaError_t adamw_fp8_step(float* param, const float* grad, uint8_t* q1, float* absmax1,
                           uint8_t* q2, float* absmax2, const BlockLayout& L, const AdamWHyper& h,
                           cudaStream_t stream) {
  if (cudaError_t e = check_layout(L); e != cudaSuccess) return e;
  if (L.num_blocks == 0) return cudaSuccess;
  const AdamWCoeffs c = adamw_coeffs(h);
  with_items(L.max_block_elems(), [&](auto items) {
    adamw_fp8_kernel<decltype(items)::value><<<grid_for(L), kThreads, 0, stream>>>(
        param, grad, q1, absmax1, q2, absmax2, L, c, nullptr, nullptr, nullptr);
  });
  return cudaGetLastError();
}

cudaError_t adamw_fp8_begin(float* param, const float* grad, const uint8_t* q1,
                            const float* absmax1, const uint8_t* q2, const float* absmax2,
                            const BlockLayout& L, const AdamWHyper& h, float* scratch,
                            float* amax1, float* amax2, cudaStream_t stream) {
  if (cudaError_t e = check_layout(L); e != cudaSuccess) return e;
  if (L.num_blocks == 0) return cudaSuccess;
  const AdamWCoeffs c = adamw_coeffs(h);
  // (the kernel writes no code nor absmax when given scratch)
  with_items(L.max_block_elems(), [&](auto items) {
    adamw_fp8_kernel<decltype(items)::value><<<grid_for(L), kThreads, 0, stream>>>(
        param, grad, const_cast<uint8_t*>(q1), const_cast<float*>(absmax1),
        const_cast<uint8_t*>(q2), const_cast<float*>(absmax2), L, c, scratch, amax1, amax2);
  });
  return cudaGetLastError();
}

cudaError_t adamw_fp8_end(const float* scratch, const BlockLayout& L, const float* agreed1,
                          const float* agreed2, uint8_t* q1, float* absmax1, uint8_t* q2,
                          float* absmax2, cudaStream_t stream) {
  if (cudaError_t e = check_layout(L); e != cudaSuccess) return e;
  if (L.num_blocks == 0) return cudaSuccess;
  adamw_fp8_end_kernel<<<grid_for(L), kThreads, 0, stream>>>(scratch, L, agreed1, agreed2, q1,
                                                             absmax1, q2, absmax2);
  return cudaGetLastError();
}

}  // namespace rfsdp::quant::cuda
