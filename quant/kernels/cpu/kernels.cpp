// The entry points of the CPU kernels: which implementation runs (the ISA in
// use) and the threads over blocks; the kernels are cpu/portable.cpp's
// and cpu/avx512.cpp's.
#include "quant/kernels/cpu/kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "quant/kernels/cpu/avx2.h"
#include "quant/kernels/cpu/avx512.h"
#include "quant/kernels/cpu/fp8.h"
#include "quant/kernels/cpu/portable.h"

namespace rfsdp::quant::cpu {

namespace {

// Blocks per task, at least: 64 Ki elements, so small tensors take no thread hand-off.
int64_t grain(const BlockLayout& L) { return std::max<int64_t>(16, (int64_t{1} << 16) / L.max_block_elems()); }

std::atomic<Isa> g_isa{[] {
  const char* env = std::getenv("RFSDP_QUANT_ISA");
  if (env && std::string(env) == "portable") return Isa::kPortable;
  if (env && std::string(env) == "avx2" && avx2::supported()) return Isa::kAvx2;
  return avx512::supported() ? Isa::kAvx512 : avx2::supported() ? Isa::kAvx2 : Isa::kPortable;
}()};

// The kernel set for a code (the vector sets need its arithmetic index).
Isa isa_for(const CodeLut& lut) { return lut.index() ? active_isa() : Isa::kPortable; }
Isa isa_for(const CodeLut& a, const CodeLut& b) {
  return a.index() && b.index() ? active_isa() : Isa::kPortable;
}

}  // namespace

Isa active_isa() { return g_isa.load(std::memory_order_relaxed); }

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::kPortable: return true;
    case Isa::kAvx2: return avx2::supported();
    case Isa::kAvx512: return avx512::supported();
  }
  return false;
}

void use_isa(Isa isa) {
  if (!isa_supported(isa)) {
    throw std::invalid_argument(std::string("this CPU cannot run the ") + isa_name(isa) +
                                " quantisation kernels");
  }
  g_isa.store(isa, std::memory_order_relaxed);
}

const char* isa_name(Isa isa) {
  return isa == Isa::kAvx512 ? "avx512" : isa == Isa::kAvx2 ? "avx2" : "portable";
}

bool quantize(const float* x, const BlockLayout& L, const CodeLut& lut, uint8_t* q,
              float* absmax) {
  std::atomic<bool> bad{false};
  const Isa isa = isa_for(lut);
  at::parallel_for(0, L.num_blocks, grain(L), [&](int64_t b0, int64_t b1) {
    bool task_bad = false;
    switch (isa) {
      case Isa::kAvx512: avx512::quantize_blocks(x, L, lut, q, absmax, b0, b1, &task_bad); break;
      case Isa::kAvx2: avx2::quantize_blocks(x, L, lut, q, absmax, b0, b1, &task_bad); break;
      case Isa::kPortable: portable::quantize_blocks(x, L, lut, q, absmax, b0, b1, &bad); break;
    }
    if (task_bad) bad.store(true, std::memory_order_relaxed);
  });
  return !bad.load();
}

void dequantize(const uint8_t* q, const float* absmax, const BlockLayout& L, const CodeLut& lut,
                float* out) {
  const Isa isa = active_isa();
  at::parallel_for(0, L.num_blocks, grain(L), [&](int64_t b0, int64_t b1) {
    switch (isa) {
      case Isa::kAvx512: return avx512::dequantize_blocks(q, absmax, L, lut, out, b0, b1);
      case Isa::kAvx2: return avx2::dequantize_blocks(q, absmax, L, lut, out, b0, b1);
      case Isa::kPortable: return portable::dequantize_blocks(q, absmax, L, lut.code(), out, b0, b1);
    }
  });
}

void adamw8bit_step(float* param, const float* grad, uint8_t* q1, float* absmax1, uint8_t* q2,
                    float* absmax2, const BlockLayout& L, const CodeLut& lut1,
                    const CodeLut& lut2, const AdamWHyper& h) {
  const AdamWCoeffs c = adamw_coeffs(h);
  const Isa isa = isa_for(lut1, lut2);
  at::parallel_for(0, L.num_blocks, grain(L), [&](int64_t b0, int64_t b1) {
    // this task's blocks of moments: m and v of one (portable, AVX2) or two (AVX-512's pipeline)
    std::vector<float> buf((isa == Isa::kAvx512 ? 4 : 2) * L.max_block_elems());
    float* vbuf = buf.data() + L.max_block_elems();
    switch (isa) {
      case Isa::kAvx512:
        return avx512::adamw8bit_blocks(param, grad, q1, absmax1, q2, absmax2, L, lut1, lut2, c,
                                        b0, b1, buf.data());
      case Isa::kAvx2:
        return avx2::adamw8bit_blocks(param, grad, q1, absmax1, q2, absmax2, L, lut1, lut2, c, b0,
                                      b1, buf.data(), vbuf);
      case Isa::kPortable:
        return portable::adamw8bit_blocks(param, grad, q1, absmax1, q2, absmax2, L, lut1, lut2, c,
                                          b0, b1, buf.data(), vbuf);
    }
  });
}

// (One thread: a tensor's shared blocks are the few at its shard's two ends.)
void adamw8bit_begin(float* param, const float* grad, const uint8_t* q1, const float* absmax1,
                     const uint8_t* q2, const float* absmax2, const BlockLayout& L,
                     const CodeLut& lut1, const CodeLut& lut2, const AdamWHyper& h,
                     float* scratch, float* amax1, float* amax2) {
  const AdamWCoeffs c = adamw_coeffs(h);
  switch (isa_for(lut1, lut2)) {
    case Isa::kAvx512:
      return avx512::adamw8bit_begin_blocks(param, grad, q1, absmax1, q2, absmax2, L, lut1, lut2,
                                            c, 0, L.num_blocks, scratch, amax1, amax2);
    case Isa::kAvx2:
      return avx2::adamw8bit_begin_blocks(param, grad, q1, absmax1, q2, absmax2, L, lut1, lut2, c,
                                          0, L.num_blocks, scratch, amax1, amax2);
    case Isa::kPortable:
      return portable::adamw8bit_begin_blocks(param, grad, q1, absmax1, q2, absmax2, L, lut1,
                                              lut2, c, 0, L.num_blocks, scratch, amax1, amax2);
  }
}

void adamw8bit_end(const float* scratch, const BlockLayout& L, const CodeLut& lut1,
                   const CodeLut& lut2, const float* agreed1, const float* agreed2, uint8_t* q1,
                   float* absmax1, uint8_t* q2, float* absmax2) {
  switch (isa_for(lut1, lut2)) {
    case Isa::kAvx512:
      return avx512::adamw8bit_end_blocks(scratch, L, lut1, lut2, agreed1, agreed2, q1, absmax1,
                                          q2, absmax2, 0, L.num_blocks);
    case Isa::kAvx2:
      return avx2::adamw8bit_end_blocks(scratch, L, lut1, lut2, agreed1, agreed2, q1, absmax1, q2,
                                        absmax2, 0, L.num_blocks);
    case Isa::kPortable:
      return portable::adamw8bit_end_blocks(scratch, L, lut1, lut2, agreed1, agreed2, q1, absmax1,
                                            q2, absmax2, 0, L.num_blocks);
  }
}

bool momentum8bit_step(const float* grad, const uint8_t* q, const float* absmax,
                       const BlockLayout& L, const CodeLut& lut, float beta, bool nesterov,
                       uint8_t* q_out, float* absmax_out, float* u) {
  std::atomic<bool> bad{false};
  const Isa isa = isa_for(lut);
  at::parallel_for(0, L.num_blocks, grain(L), [&](int64_t b0, int64_t b1) {
    std::vector<float> buf(L.max_block_elems());  // this task's block of m
    bool task_bad = false;
    switch (isa) {
      case Isa::kAvx512:
        avx512::momentum8bit_blocks(grad, q, absmax, L, lut, beta, nesterov, q_out, absmax_out, u,
                                    b0, b1, buf.data(), &task_bad);
        break;
      case Isa::kAvx2:
        avx2::momentum8bit_blocks(grad, q, absmax, L, lut, beta, nesterov, q_out, absmax_out, u,
                                  b0, b1, buf.data(), &task_bad);
        break;
      case Isa::kPortable:
        portable::momentum8bit_blocks(grad, q, absmax, L, lut, beta, nesterov, q_out, absmax_out,
                                      u, b0, b1, buf.data(), &bad);
        break;
    }
    if (task_bad) bad.store(true, std::memory_order_relaxed);
  });
  return !bad.load();
}

// The float8 kernels of the set in use (they need no code index).
static const Fp8Kernels& fp8_set() {
  switch (active_isa()) {
    case Isa::kAvx512: return avx512::fp8_kernels();
    case Isa::kAvx2: return avx2::fp8_kernels();
    case Isa::kPortable: break;
  }
  return portable::fp8_kernels();
}

bool quantize_fp8(const float* x, const BlockLayout& L, bool keep_nonzero, uint8_t* q,
                  float* absmax) {
  std::atomic<bool> bad{false};
  const Fp8Kernels& k = fp8_set();
  at::parallel_for(0, L.num_blocks, grain(L), [&](int64_t b0, int64_t b1) {
    bool task_bad = false;
    k.quantize(x, L, keep_nonzero, q, absmax, b0, b1, &task_bad);
    if (task_bad) bad.store(true, std::memory_order_relaxed);
  });
  return !bad.load();
}

void dequantize_fp8(const uint8_t* q, const float* absmax, const BlockLayout& L, float* out) {
  const Fp8Kernels& k = fp8_set();
  at::parallel_for(0, L.num_blocks, grain(L),
                   [&](int64_t b0, int64_t b1) { k.dequantize(q, absmax, L, out, b0, b1); });
}

void adamw_fp8_step(float* param, const float* grad, uint8_t* q1, float* absmax1, uint8_t* q2,
                    float* absmax2, const BlockLayout& L, const AdamWHyper& h) {
  const AdamWCoeffs c = adamw_coeffs(h);
  const Fp8Kernels& k = fp8_set();
  at::parallel_for(0, L.num_blocks, grain(L), [&](int64_t b0, int64_t b1) {
    std::vector<float> buf(4 * L.max_block_elems());  // this task's two blocks of m and of v
    k.adamw(param, grad, q1, absmax1, q2, absmax2, L, c, b0, b1, buf.data(),
            buf.data() + 2 * L.max_block_elems());
  });
}

void adamw_fp8_begin(float* param, const float* grad, const uint8_t* q1, const float* absmax1,
                     const uint8_t* q2, const float* absmax2, const BlockLayout& L,
                     const AdamWHyper& h, float* scratch, float* amax1, float* amax2) {
  fp8_set().adamw_begin(param, grad, q1, absmax1, q2, absmax2, L, adamw_coeffs(h), 0,
                        L.num_blocks, scratch, amax1, amax2);
}

void adamw_fp8_end(const float* scratch, const BlockLayout& L, const float* agreed1,
                   const float* agreed2, uint8_t* q1, float* absmax1, uint8_t* q2,
                   float* absmax2) {
  fp8_set().adamw_end(scratch, L, agreed1, agreed2, q1, absmax1, q2, absmax2, 0, L.num_blocks);
}

bool momentum_fp8_step(const float* grad, const uint8_t* q, const float* absmax,
                       const BlockLayout& L, float beta, bool nesterov, uint8_t* q_out,
                       float* absmax_out, float* u) {
  std::atomic<bool> bad{false};
  const Fp8Kernels& k = fp8_set();
  at::parallel_for(0, L.num_blocks, grain(L), [&](int64_t b0, int64_t b1) {
    std::vector<float> buf(2 * L.max_block_elems());  // this task's two blocks of m
    bool task_bad = false;
    k.momentum(grad, q, absmax, L, beta, nesterov, q_out, absmax_out, u, b0, b1, buf.data(),
               &task_bad);
    if (task_bad) bad.store(true, std::memory_order_relaxed);
  });
  return !bad.load();
}

void adamw32_step(float* param, const float* grad, float* m, float* v, int64_t n,
                  const AdamWHyper& h) {
  const AdamWCoeffs c = adamw_coeffs(h);
  at::parallel_for(0, n, int64_t{1} << 16, [&](int64_t i0, int64_t i1) {
    portable::adamw32_range(param, grad, m, v, c, i0, i1);
  });
}

}  // namespace rfsdp::quant::cpu
