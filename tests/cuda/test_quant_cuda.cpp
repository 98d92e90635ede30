// The CUDA quantisation kernels against the CPU ones, on a GPU. Built when
// nvcc is found; exits 77 (reported as skipped) where no GPU is present.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "quant/formats/code_maps.h"
#include "quant/kernels/cpu/kernels.h"
#include "quant/kernels/cuda/kernels.h"

using namespace rfsdp::quant;

namespace {

int failures = 0;
#define EXPECT_OK(cond, ...)                        \
  do {                                            \
    if (!(cond)) {                                \
      std::fprintf(stderr, "FAIL: " __VA_ARGS__); \
      std::fprintf(stderr, "\n");                 \
      ++failures;                                 \
    }                                             \
  } while (0)

template <class T>
T* to_device(const std::vector<T>& v) {
  T* d = nullptr;
  cudaMalloc(&d, v.size() * sizeof(T));
  cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  return d;
}

template <class T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> v(n);
  cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost);
  return v;
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: skipped\n");
    return 77;
  }
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> normal;
  const at::Tensor code_t = dynamic_map(true), code_u = dynamic_map(false);
  const std::vector<float> c1(code_t.data_ptr<float>(), code_t.data_ptr<float>() + 256);
  const std::vector<float> c2(code_u.data_ptr<float>(), code_u.data_ptr<float>() + 256);
  const auto lut1 = code_lut(code_t), lut2 = code_lut(code_u, /*keep_nonzero=*/true);
  // Every register width the kernels are built for (1, 2, 4, 8, 16 elements a thread).
  for (BlockShape shape : {BlockShape::blocks(256), BlockShape::blocks(512), BlockShape::blocks(2048),
                           BlockShape::blocks(4096), BlockShape::tiles(32, 32),
                           BlockShape::tiles(64, 64), BlockShape::tiles(5, 7)}) {
    const int64_t rows = 333, row_len = 77, n = rows * row_len;
    const BlockLayout L(shape, rows, row_len);
    std::vector<float> x(n);
    for (auto& v : x) v = normal(rng);
    // Quantise / dequantise: bit-identical to the CPU (same float operations).
    std::vector<uint8_t> q_cpu(n);
    std::vector<float> a_cpu(L.num_blocks), out_cpu(n);
    cpu::quantize(x.data(), L, *lut1, q_cpu.data(), a_cpu.data());
    cpu::dequantize(q_cpu.data(), a_cpu.data(), L, *lut1, out_cpu.data());
    float* dx = to_device(x);
    float* dc = to_device(c1);
    uint8_t* dq = to_device(std::vector<uint8_t>(n, 0xAB));
    float* da = to_device(std::vector<float>(L.num_blocks, -1.0f));
    float* dout = to_device(std::vector<float>(n, NAN));
    // the binary search (no index) first, then the arithmetic index
    EXPECT_OK(cuda::quantize(dx, L, dc, {}, dq, da, nullptr) == cudaSuccess, "quantize launch");
    EXPECT_OK(cudaDeviceSynchronize() == cudaSuccess, "sync");
    EXPECT_OK(to_host(dq, n) == q_cpu, "%s: searched codes differ from the CPU", shape.str().c_str());
    EXPECT_OK(cuda::quantize(dx, L, dc, {lut1->index(), false}, dq, da, nullptr) == cudaSuccess,
              "quantize launch");
    EXPECT_OK(cuda::dequantize(dq, da, L, dc, dout, nullptr) == cudaSuccess, "dequantize launch");
    EXPECT_OK(cudaDeviceSynchronize() == cudaSuccess, "sync");
    EXPECT_OK(to_host(dq, n) == q_cpu, "%s: codes differ from the CPU", shape.str().c_str());
    EXPECT_OK(to_host(da, L.num_blocks) == a_cpu, "%s: absmax differs", shape.str().c_str());
    EXPECT_OK(to_host(dout, n) == out_cpu, "%s: dequantised values differ", shape.str().c_str());
    // Fused AdamW8bit: 5 steps against the CPU step (FMA contraction may move
    // the last bit, so: parameters to 1e-6, codes within one step). The CPU's
    // portable kernels: IEEE square root and division, as the GPU's.
    cpu::use_isa(cpu::Isa::kPortable);
    std::vector<float> p(n), g(n);
    for (auto& v : p) v = normal(rng);
    std::vector<uint8_t> q1(n, lut1->nearest(0.0f)), q2(n, lut2->nearest(0.0f));
    std::vector<float> a1(L.num_blocks, 0.0f), a2(L.num_blocks, 0.0f);
    float* dp = to_device(p);
    float* dg = to_device(g);
    float* dc2 = to_device(c2);
    uint8_t* dq1 = to_device(q1);
    uint8_t* dq2 = to_device(q2);
    float* da1 = to_device(a1);
    float* da2 = to_device(a2);
    for (int step = 1; step <= 5; ++step) {
      for (auto& v : g) v = 1e-2f * normal(rng);
      cudaMemcpy(dg, g.data(), n * 4, cudaMemcpyHostToDevice);
      cpu::adamw8bit_step(p.data(), g.data(), q1.data(), a1.data(), q2.data(), a2.data(), L,
                          *lut1, *lut2, {1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, step});
      EXPECT_OK(cuda::adamw8bit_step(dp, dg, dq1, da1, dq2, da2, L, dc, {lut1->index(), false}, dc2,
                                     {lut2->index(), true},
                                 {1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, step}, nullptr) == cudaSuccess,
            "adamw8bit launch");
    }
    EXPECT_OK(cudaDeviceSynchronize() == cudaSuccess, "sync");
    const auto gp = to_host(dp, n);
    const auto gq1 = to_host(dq1, n);
    double perr = 0;
    int far = 0;
    for (int64_t i = 0; i < n; ++i) {
      perr = std::max(perr, std::fabs(double(gp[i]) - p[i]));
      far += std::abs(int(gq1[i]) - int(q1[i])) > 1;
    }
    EXPECT_OK(perr < 1e-5, "%s: adamw8bit parameters differ by %g", shape.str().c_str(), perr);
    EXPECT_OK(far == 0, "%s: %d first-moment codes differ by more than one", shape.str().c_str(), far);
    for (void* d : {(void*)dx, (void*)dc, (void*)dq, (void*)da, (void*)dout, (void*)dp, (void*)dg,
                    (void*)dc2, (void*)dq1, (void*)dq2, (void*)da1, (void*)da2}) {
      cudaFree(d);
    }
  }
  std::printf("%s\n", failures ? "FAILED" : "1 passed, 0 failed");
  return failures ? 1 : 0;
}
