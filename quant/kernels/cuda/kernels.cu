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

// The two state formats as the kernels below see them: a kernel declares
// `__shared__ typename C::Shared`, every thread calls C::load before the first
// barrier, then per block prepares a scale from the block's absmax and decodes
// or encodes each element with it.
//  DynamicMap: the 256-value code in shared memory (loaded once per thread
//    block, not once per 1 KiB quantisation block), value = code[q] * absmax,
//    q = the nearest code to v / absmax (SharedCode).
//  Fp8E4M3 (formats/fp8_e4m3.h): codes by arithmetic, nothing shared.
// Products are __fmul_rn: never contracted into a neighbouring add, so codes
// and moments equal the CPU kernels' bit for bit.
struct DynamicMap {
  struct Arg {
    const float* code;
    IndexArg rounding;
  };
  struct Shared {
    float code[256];
    SharedCode near;
  };
  __device__ static void load(Shared& s, const Arg& a) {
    s.code[threadIdx.x] = a.code[threadIdx.x];  // kThreads == 256
    s.near.load(a.code, a.rounding.ix, a.rounding.has, a.rounding.keep_nonzero);
  }
  __device__ static float decode_scale(float absmax) { return absmax; }
  __device__ static float decode(const Shared& s, uint8_t q, float scale) {
    return __fmul_rn(s.code[q], scale);
  }
  __device__ static float encode_scale(float amax) { return amax > 0.0f ? 1.0f / amax : 0.0f; }
  __device__ static uint8_t encode(const Shared& s, const Arg&, float v, float scale) {
    return s.near.nearest(__fmul_rn(v, scale));
  }
};

struct Fp8E4M3 {
  struct Arg {
    bool keep_nonzero;
  };
  struct Shared {};
  __device__ static void load(Shared&, const Arg&) {}
  __device__ static float decode_scale(float absmax) { return fp8::decode_scale(absmax); }
  __device__ static float decode(const Shared&, uint8_t q, float scale) {
    return __fmul_rn(fp8::decode(q), scale);
  }
  __device__ static float encode_scale(float amax) { return fp8::encode_scale(amax); }
  __device__ static uint8_t encode(const Shared&, const Arg& a, float v, float scale) {
    return fp8::encode(__fmul_rn(v, scale), a.keep_nonzero);
  }
};

// Every kernel walks the quantisation blocks grid-stride, a thread block taking
// one block at a time.
template <int kItems, class C>
__global__ void quantize_kernel(const float* __restrict x, BlockLayout L, typename C::Arg a,
                                uint8_t* __restrict q, float* __restrict absmax) {
  __shared__ typename C::Shared sh;
  __shared__ float scratch[32];
  C::load(sh, a);
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
    const float s = C::encode_scale(amax);
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int k = threadIdx.x + i * kThreads;
      if (k < count) q[element(b, L.row_len, k)] = C::encode(sh, a, v[i], s);
    }
    if (threadIdx.x == 0) absmax[blk] = amax;
  }
}

template <class C>
__global__ void dequantize_kernel(const uint8_t* __restrict q, const float* __restrict absmax,
                                  BlockLayout L, typename C::Arg a, float* __restrict out) {
  __shared__ typename C::Shared sh;
  C::load(sh, a);
  __syncthreads();
  for (int64_t blk = blockIdx.x; blk < L.num_blocks; blk += gridDim.x) {
    const BlockLayout::Block b = L.block(blk);
    const int count = static_cast<int>(b.count);
    const float s = C::decode_scale(absmax[blk]);
    for (int k = threadIdx.x; k < count; k += kThreads) {
      const int64_t e = element(b, L.row_len, k);
      out[e] = C::decode(sh, q[e], s);
    }
  }
}

// The fused AdamW step (scratch null: whole blocks), or, for blocks that ranks
// share, its first half: the new moments into scratch (block b's m at 2 b w, its
// v at (2 b + 1) w, w = L.max_block_elems(), as the CPU kernels keep them) and
// this rank's max |.| per block into amax1_out, amax2_out, no code nor absmax
// written; adamw_end_kernel is the second half, after the agreement.
template <int kItems, class C>
__global__ void adamw_kernel(float* __restrict p, const float* __restrict g,
                             uint8_t* __restrict q1, float* __restrict absmax1,
                             uint8_t* __restrict q2, float* __restrict absmax2, BlockLayout L,
                             typename C::Arg a1, typename C::Arg a2, AdamWCoeffs c,
                             float* __restrict scratch, float* __restrict amax1_out,
                             float* __restrict amax2_out) {
  __shared__ typename C::Shared sh1, sh2;
  __shared__ float scratch_max[32];
  C::load(sh1, a1);
  C::load(sh2, a2);
  __syncthreads();
  const int64_t w = L.max_block_elems();
  for (int64_t blk = blockIdx.x; blk < L.num_blocks; blk += gridDim.x) {
    const BlockLayout::Block b = L.block(blk);
    const int count = static_cast<int>(b.count);
    const float d1 = C::decode_scale(absmax1[blk]), d2 = C::decode_scale(absmax2[blk]);
    float m[kItems], v[kItems];
    float amax1 = 0.0f, amax2 = 0.0f;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int k = threadIdx.x + i * kThreads;
      m[i] = v[i] = 0.0f;
      if (k < count) {
        const int64_t e = element(b, L.row_len, k);
        m[i] = C::decode(sh1, q1[e], d1);
        v[i] = C::decode(sh2, q2[e], d2);
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
    const float s1 = C::encode_scale(amax1), s2 = C::encode_scale(amax2);
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int k = threadIdx.x + i * kThreads;
      if (k < count) {
        const int64_t e = element(b, L.row_len, k);
        q1[e] = C::encode(sh1, a1, m[i], s1);
        q2[e] = C::encode(sh2, a2, v[i], s2);
      }
    }
    if (threadIdx.x == 0) {
      absmax1[blk] = amax1;
      absmax2[blk] = amax2;
    }
  }
}

template <class C>
__global__ void adamw_end_kernel(const float* __restrict scratch, BlockLayout L, typename C::Arg a1,
                                 typename C::Arg a2, const float* __restrict agreed1,
                                 const float* __restrict agreed2, uint8_t* __restrict q1,
                                 float* __restrict absmax1, uint8_t* __restrict q2,
                                 float* __restrict absmax2) {
  __shared__ typename C::Shared sh1, sh2;
  C::load(sh1, a1);
  C::load(sh2, a2);
  __syncthreads();
  const int64_t w = L.max_block_elems();
  for (int64_t blk = blockIdx.x; blk < L.num_blocks; blk += gridDim.x) {
    const BlockLayout::Block b = L.block(blk);
    const int count = static_cast<int>(b.count);
    const float a1v = agreed1[blk], a2v = agreed2[blk];
    const float s1 = C::encode_scale(a1v), s2 = C::encode_scale(a2v);
    for (int k = threadIdx.x; k < count; k += kThreads) {
      const int64_t e = element(b, L.row_len, k);
      q1[e] = C::encode(sh1, a1, scratch[2 * blk * w + k], s1);
      q2[e] = C::encode(sh2, a2, scratch[(2 * blk + 1) * w + k], s2);
    }
    if (threadIdx.x == 0) {
      absmax1[blk] = a1v;
      absmax2[blk] = a2v;
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

// The launches, one per kernel and format.
template <class C>
cudaError_t launch_quantize(const float* x, const BlockLayout& L, typename C::Arg a, uint8_t* q,
                            float* absmax, cudaStream_t stream) {
  if (cudaError_t e = check_layout(L); e != cudaSuccess) return e;
  if (L.num_blocks == 0) return cudaSuccess;
  with_items(L.max_block_elems(), [&](auto items) {
    quantize_kernel<decltype(items)::value, C><<<grid_for(L), kThreads, 0, stream>>>(x, L, a, q,
                                                                                    absmax);
  });
  return cudaGetLastError();
}

template <class C>
cudaError_t launch_dequantize(const uint8_t* q, const float* absmax, const BlockLayout& L,
                              typename C::Arg a, float* out, cudaStream_t stream) {
  if (cudaError_t e = check_layout(L); e != cudaSuccess) return e;
  if (L.num_blocks == 0) return cudaSuccess;
  dequantize_kernel<C><<<grid_for(L), kThreads, 0, stream>>>(q, absmax, L, a, out);
  return cudaGetLastError();
}

// scratch null: the fused step; else the first half (q1, absmax1, q2, absmax2 read only).
template <class C>
cudaError_t launch_adamw(float* param, const float* grad, const uint8_t* q1, const float* absmax1,
                         const uint8_t* q2, const float* absmax2, const BlockLayout& L,
                         typename C::Arg a1, typename C::Arg a2, const AdamWHyper& h,
                         float* scratch, float* amax1, float* amax2, cudaStream_t stream) {
  if (cudaError_t e = check_layout(L); e != cudaSuccess) return e;
  if (L.num_blocks == 0) return cudaSuccess;
  const AdamWCoeffs c = adamw_coeffs(h);
  with_items(L.max_block_elems(), [&](auto items) {
    adamw_kernel<decltype(items)::value, C><<<grid_for(L), kThreads, 0, stream>>>(
        param, grad, const_cast<uint8_t*>(q1), const_cast<float*>(absmax1),
        const_cast<uint8_t*>(q2), const_cast<float*>(absmax2), L, a1, a2, c, scratch, amax1,
        amax2);
  });
  return cudaGetLastError();
}

template <class C>
cudaError_t launch_adamw_end(const float* scratch, const BlockLayout& L, typename C::Arg a1,
                             typename C::Arg a2, const float* agreed1, const float* agreed2,
                             uint8_t* q1, float* absmax1, uint8_t* q2, float* absmax2,
                             cudaStream_t stream) {
  if (cudaError_t e = check_layout(L); e != cudaSuccess) return e;
  if (L.num_blocks == 0) return cudaSuccess;
  adamw_end_kernel<C><<<grid_for(L), kThreads, 0, stream>>>(scratch, L, a1, a2, agreed1, agreed2,
                                                            q1, absmax1, q2, absmax2);
  return cudaGetLastError();
}

DynamicMap::Arg map_arg(const float* code, CodeRounding r) { return {code, index_arg(r)}; }

}  // namespace

cudaError_t quantize(const float* x, const BlockLayout& L, const float* code,
                     CodeRounding rounding, uint8_t* q, float* absmax, cudaStream_t stream) {
  return launch_quantize<DynamicMap>(x, L, map_arg(code, rounding), q, absmax, stream);
}

cudaError_t dequantize(const uint8_t* q, const float* absmax, const BlockLayout& L,
                       const float* code, float* out, cudaStream_t stream) {
  return launch_dequantize<DynamicMap>(q, absmax, L, map_arg(code, {}), out, stream);
}

cudaError_t adamw8bit_step(float* param, const float* grad, uint8_t* q1, float* absmax1,
                           uint8_t* q2, float* absmax2, const BlockLayout& L, const float* code1,
                           CodeRounding rounding1, const float* code2, CodeRounding rounding2,
                           const AdamWHyper& h, cudaStream_t stream) {
  return launch_adamw<DynamicMap>(param, grad, q1, absmax1, q2, absmax2, L,
                                  map_arg(code1, rounding1), map_arg(code2, rounding2), h, nullptr,
                                  nullptr, nullptr, stream);
}

cudaError_t adamw8bit_begin(float* param, const float* grad, const uint8_t* q1,
                            const float* absmax1, const uint8_t* q2, const float* absmax2,
                            const BlockLayout& L, const float* code1, const float* code2,
                            const AdamWHyper& h, float* scratch, float* amax1, float* amax2,
                            cudaStream_t stream) {
  // (no code written: the rounding is the end's)
  return launch_adamw<DynamicMap>(param, grad, q1, absmax1, q2, absmax2, L, map_arg(code1, {}),
                                  map_arg(code2, {}), h, scratch, amax1, amax2, stream);
}

cudaError_t adamw8bit_end(const float* scratch, const BlockLayout& L, const float* code1,
                          CodeRounding rounding1, const float* code2, CodeRounding rounding2,
                          const float* agreed1, const float* agreed2, uint8_t* q1, float* absmax1,
                          uint8_t* q2, float* absmax2, cudaStream_t stream) {
  return launch_adamw_end<DynamicMap>(scratch, L, map_arg(code1, rounding1),
                                      map_arg(code2, rounding2), agreed1, agreed2, q1, absmax1, q2,
                                      absmax2, stream);
}

cudaError_t quantize_fp8(const float* x, const BlockLayout& L, bool keep_nonzero, uint8_t* q,
                         float* absmax, cudaStream_t stream) {
  return launch_quantize<Fp8E4M3>(x, L, {keep_nonzero}, q, absmax, stream);
}

cudaError_t dequantize_fp8(const uint8_t* q, const float* absmax, const BlockLayout& L,
                           float* out, cudaStream_t stream) {
  return launch_dequantize<Fp8E4M3>(q, absmax, L, {false}, out, stream);
}

// AdamW's m signed, v keep_nonzero.
cudaError_t adamw_fp8_step(float* param, const float* grad, uint8_t* q1, float* absmax1,
                           uint8_t* q2, float* absmax2, const BlockLayout& L, const AdamWHyper& h,
                           cudaStream_t stream) {
  return launch_adamw<Fp8E4M3>(param, grad, q1, absmax1, q2, absmax2, L, {false}, {true}, h,
                               nullptr, nullptr, nullptr, stream);
}

cudaError_t adamw_fp8_begin(float* param, const float* grad, const uint8_t* q1,
                            const float* absmax1, const uint8_t* q2, const float* absmax2,
                            const BlockLayout& L, const AdamWHyper& h, float* scratch,
                            float* amax1, float* amax2, cudaStream_t stream) {
  return launch_adamw<Fp8E4M3>(param, grad, q1, absmax1, q2, absmax2, L, {false}, {true}, h,
                               scratch, amax1, amax2, stream);
}

cudaError_t adamw_fp8_end(const float* scratch, const BlockLayout& L, const float* agreed1,
                          const float* agreed2, uint8_t* q1, float* absmax1, uint8_t* q2,
                          float* absmax2, cudaStream_t stream) {
  return launch_adamw_end<Fp8E4M3>(scratch, L, {false}, {true}, agreed1, agreed2, q1, absmax1, q2,
                                   absmax2, stream);
}

}  // namespace rfsdp::quant::cuda
