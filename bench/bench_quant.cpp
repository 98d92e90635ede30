// bench_quant: block-wise 8-bit quantise / dequantise and the fused AdamW8bit
// step, against a plain memcpy of the same bytes (the floor) and against the
// fp32 AdamW step, from 1M to 64M elements, with each kernel set this CPU runs
// (portable, AVX2 and AVX-512 where present) and the device-generic path side by side. One thread by default
// (rates per core); --threads N for more. Medians of --reps runs.
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "quant/formats/code_maps.h"
#include "quant/kernels/cpu/kernels.h"
#include "quant/ops/blockwise.h"
#include "quant/ops/device_path.h"
#include "quant/ops/lowbit.h"
#include "quant/ops/state_ops.h"

#include <ATen/ops/_fused_adamw_ops.h>

namespace {

using namespace rfsdp::quant;

template <class F>
double median_seconds(int reps, F&& f) {
  std::vector<double> t;
  f();  // warm-up: first touch of outputs, table build
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

std::string cpu_model() {
  std::FILE* f = std::fopen("/proc/cpuinfo", "r");
  char line[512];
  std::string model = "cpu: unknown";
  while (f && std::fgets(line, sizeof line, f)) {
    if (!std::strncmp(line, "model name", 10)) {
      model = std::string("cpu:") + (std::strchr(line, ':') + 1);
      model.pop_back();
      break;
    }
  }
  if (f) std::fclose(f);
  return model;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 1, reps = 5;
  int64_t max_m = 64;
  std::string only;  // --paths: a comma-separated subset of portable, avx2, avx512, generic
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--threads") && i + 1 < argc) threads = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--max-mib") && i + 1 < argc) max_m = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--paths") && i + 1 < argc) only = "," + std::string(argv[++i]) + ",";
    else {
      std::fprintf(stderr, "usage: bench_quant [--threads N] [--reps N] [--max-mib M] "
                           "[--paths portable,avx2,avx512,generic]\n");
      return 2;
    }
  }
  at::set_num_threads(threads);
  const at::Tensor code1 = dynamic_map(true), code2 = dynamic_map(false);
  const auto lut1 = code_lut(code1), lut2 = code_lut(code2);
  std::printf("%s\n", cpu_model().c_str());
  std::printf("threads %d, medians of %d; GB/s = bytes read + written / time; memcpy of the same "
              "bytes is the floor\n\n",
              threads, reps);
  auto wanted = [&](const char* path) {
    return only.empty() || only.find("," + std::string(path) + ",") != std::string::npos;
  };
  std::vector<cpu::Isa> isas;
  for (cpu::Isa isa : {cpu::Isa::kPortable, cpu::Isa::kAvx2, cpu::Isa::kAvx512}) {
    if (cpu::isa_supported(isa) && wanted(cpu::isa_name(isa))) isas.push_back(isa);
  }
  std::printf("%-7s %-10s %-8s | %9s %9s %6s | %9s %9s %6s | %9s %9s %9s %6s\n", "elems", "blocks",
              "kernels", "quant", "memcpy", "ratio", "dequant", "memcpy", "ratio", "adam8 GB/s",
              "adam32", "memcpy", "t32/t8");
  for (int64_t mi = 1; mi <= max_m; mi *= 4) {
    const int64_t n = mi << 20;
    for (BlockShape shape : {BlockShape::blocks(256), BlockShape::blocks(2048),
                             BlockShape::tiles(32, 32)}) {
      const at::Tensor x = at::randn({n / 1024, 1024});
      const BlockLayout L = layout_of(x, shape, 1024);
      at::Tensor q = at::empty({n}, at::kByte), absmax = at::empty({L.num_blocks});
      at::Tensor out = at::empty({n});
      std::vector<char> src(n * 8), dst(n * 8);
      std::memset(src.data(), 1, src.size());
      auto memcpy_s = [&](int64_t bytes) {
        return median_seconds(reps, [&] {
          at::parallel_for(0, bytes, 1 << 20, [&](int64_t a, int64_t b) {
            std::memcpy(dst.data() + a, src.data() + a, b - a);
          });
        });
      };
      for (cpu::Isa isa : isas) {
      cpu::use_isa(isa);
      // Quantise: read 4 B, write 1 B (+ absmax) per element.
      const double tq = median_seconds(reps, [&] {
        cpu::quantize(x.data_ptr<float>(), L, *lut1, q.data_ptr<uint8_t>(), absmax.data_ptr<float>());
      });
      const double bytes_q = n * 5.0;
      const double tmq = memcpy_s(static_cast<int64_t>(bytes_q / 2));  // memcpy moves 2x its size
      const double td = median_seconds(reps, [&] {
        cpu::dequantize(q.data_ptr<uint8_t>(), absmax.data_ptr<float>(), L, *lut1,
                        out.data_ptr<float>());
      });
      // AdamW8bit: param r/w (8) + grad r (4) + two 8-bit states r/w (4) = 16 B per element.
      at::Tensor p = at::randn({n}), g = at::randn({n}) * 1e-3;
      at::Tensor q1 = at::full({n}, 127, at::kByte), q2 = at::zeros({n}, at::kByte);
      at::Tensor a1 = at::zeros({L.num_blocks}), a2 = at::zeros({L.num_blocks});
      AdamWHyper h{1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, 1};
      const double t8 = median_seconds(reps, [&] {
        cpu::adamw8bit_step(p.data_ptr<float>(), g.data_ptr<float>(), q1.data_ptr<uint8_t>(),
                            a1.data_ptr<float>(), q2.data_ptr<uint8_t>(), a2.data_ptr<float>(), L,
                            *lut1, *lut2, h);
      });
      // fp32 AdamW: param r/w (8) + grad r (4) + m r/w (8) + v r/w (8) = 28 B per element.
      at::Tensor m = at::zeros({n}), v = at::zeros({n});
      const double t32 = median_seconds(reps, [&] {
        cpu::adamw32_step(p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(),
                          v.data_ptr<float>(), n, h);
      });
      const double tm8 = memcpy_s(n * 8);
      std::printf("%-7s %-10s %-8s | %9.2f %9.2f %6.2f | %9.2f %9.2f %6.2f | %9.2f %9.2f %9.2f %6.2f\n",
                  (std::to_string(mi) + "M").c_str(),
                  (shape.is_tile() ? std::to_string(shape.tile_rows) + "x" + std::to_string(shape.tile_cols)
                                   : "B=" + std::to_string(shape.block)).c_str(),
                  cpu::isa_name(isa), bytes_q / tq / 1e9, bytes_q / tmq / 1e9, tmq / tq,
                  bytes_q / td / 1e9, bytes_q / tmq / 1e9, tmq / td, n * 16.0 / t8 / 1e9,
                  n * 28.0 / t32 / 1e9, n * 16.0 / tm8 / 1e9, t32 / t8);
      }
    }
  }
  std::printf("\nratio: memcpy's time over the kernel's (1 = at memcpy speed); t32/t8: fp32 "
              "AdamW's time per parameter over AdamW8bit's (>= 1: the 8-bit step is as fast or "
              "faster)\n");
  std::printf("state bytes per parameter: AdamW 8 (two fp32 moments); AdamW8bit 2 + 8/B "
              "(two uint8 moments and two fp32 absmax per block: B=256 -> 2.031, B=2048 -> "
              "2.004, 32x32 tiles -> 2.008)\n");

  // Muon's 8-bit momentum (blocks of 256): codes r/w (2) + grad r (4) + update w (4) = 10 B
  // per element, against memcpy of as many bytes and the fp32 momentum as Muon steps it
  // (m' = lerp(m, g), u = lerp(g, m'), m <- m': 36 B per element through ATen).
  std::printf("\n%-7s %-8s | %12s %9s %6s | %12s %8s\n", "elems", "kernels", "mom8 GB/s", "memcpy",
              "ratio", "fp32 GB/s", "t32/t8");
  const auto lut = code_lut(dynamic_map(true));
  for (int64_t mi = 1; mi <= max_m; mi *= 4) {
    const int64_t n = mi << 20;
    const BlockLayout L(BlockShape::blocks(256), 1, n);
    at::Tensor g = at::randn({n}), u = at::empty({n}), q = at::full({n}, 127, at::kByte);
    at::Tensor q2 = at::empty({n}, at::kByte), a = at::ones({L.num_blocks}), a2 = at::empty({L.num_blocks});
    at::Tensor m = at::randn({n});
    std::vector<char> src(n * 10), dst(n * 10);
    std::memset(src.data(), 1, src.size());
    std::vector<double> t8;
    for (cpu::Isa isa : isas) {
      cpu::use_isa(isa);
      t8.push_back(median_seconds(reps, [&] {
        cpu::momentum8bit_step(g.data_ptr<float>(), q.data_ptr<uint8_t>(), a.data_ptr<float>(), L,
                               *lut, 0.95f, true, q2.data_ptr<uint8_t>(), a2.data_ptr<float>(),
                               u.data_ptr<float>());
      }));
    }
    const double tm = median_seconds(reps, [&] {
      at::parallel_for(0, n * 5, 1 << 20, [&](int64_t x, int64_t y) {
        std::memcpy(dst.data() + x, src.data() + x, y - x);
      });
    });
    const double t32 = median_seconds(reps, [&] {
      const at::Tensor nm = m.lerp(g, 0.05);
      const at::Tensor uu = g.lerp(nm, 0.95);
      m.copy_(nm);
    });
    for (size_t i = 0; i < isas.size(); ++i) {
      std::printf("%-7s %-8s | %12.2f %9.2f %6.2f | %12.2f %8.2f\n", (std::to_string(mi) + "M").c_str(),
                  cpu::isa_name(isas[i]), n * 10.0 / t8[i] / 1e9, n * 10.0 / tm / 1e9, tm / t8[i],
                  n * 36.0 / t32 / 1e9, t32 / t8[i]);
    }
  }

  // Every path side by side on the 8-bit states' operations (1-D blocks of 256), through
  // the entry points the optimizers call (quant/ops/state_ops.h): each kernel set
  // this CPU runs and the device-generic ATen path (what a device without kernels runs;
  // the same bits). Ratios: memcpy of the bytes an operation moves over its time (1 = at
  // memcpy speed), and t8/t: the AdamW8bit step's time (16 B a parameter) over torch's
  // fused fp32 AdamW step's (torch.optim.AdamW(fused=True), 28 B a parameter), timed
  // beside it: below 1 is faster (0.57 the bytes' floor).
  // Each path with both state formats (format "dyn": the dynamic maps; "fp8":
  // float8_e4m3fn codes, quant/formats/fp8_e4m3.h), 1M (in cache), 4M and 16M.
  std::printf("\n%-7s %-9s %-4s | %8s %6s | %8s %6s | %8s %8s %7s | %8s %6s\n", "elems", "path",
              "fmt", "quant ms", "xmemcp", "deq ms", "xmemcp", "adam8 ms", "torch ms", "t8/t",
              "mom8 ms", "xmemcp");
  for (int64_t mi : {int64_t{1}, int64_t{4}, int64_t{16}}) {
    if (mi > max_m) break;
    const int64_t n = mi << 20;
    const BlockLayout L(BlockShape::blocks(256), 1, n);
    const Codec k1(code1), k2(code2, true);
    const at::Tensor x = at::randn({n}), g = at::randn({n}) * 1e-3;
    at::Tensor q = at::empty({n}, at::kByte), a = at::empty({L.num_blocks}), out = at::empty({n});
    at::Tensor p = at::randn({n}), q1 = at::full({n}, 127, at::kByte), q2 = at::zeros({n}, at::kByte);
    at::Tensor a1 = at::zeros({L.num_blocks}), a2 = at::zeros({L.num_blocks}), u = at::empty({n});
    at::Tensor qm = at::full({n}, 127, at::kByte), am = at::ones({L.num_blocks});
    at::Tensor qm2 = at::empty({n}, at::kByte), am2 = at::empty({L.num_blocks});
    std::vector<char> src(n * 16), dst(n * 16);
    std::memset(src.data(), 1, src.size());
    auto memcpy_s = [&](int64_t bytes) {  // reads + writes = 2 x bytes
      return median_seconds(reps, [&] {
        at::parallel_for(0, bytes, 1 << 20, [&](int64_t b0, int64_t b1) {
          std::memcpy(dst.data() + b0, src.data() + b0, b1 - b0);
        });
      });
    };
    const double mq = memcpy_s(n * 5 / 2), mm = memcpy_s(n * 10 / 2);
    at::Tensor tp = at::randn({n}), tm = at::zeros({n}), tv = at::zeros({n});
    const at::Tensor steps = at::full({}, 1.0);
    struct Path {
      const char* name;
      cpu::Isa isa;
      bool generic;
    };
    std::vector<Path> paths;
    for (cpu::Isa isa : isas) paths.push_back({cpu::isa_name(isa), isa, false});
    if (wanted("generic")) paths.push_back({"generic", cpu::active_isa(), true});
    const Codec f1 = Codec::float8_e4m3(false), f2 = Codec::float8_e4m3(true);
    for (const Path& path : paths) {
      cpu::use_isa(path.isa);
      use_device_generic_path(path.generic);
      for (int fp8 = 0; fp8 < 2; ++fp8) {
        const Codec& c1 = fp8 ? f1 : k1;
        const Codec& c2 = fp8 ? f2 : k2;
        if (fp8) {  // states that decode: the codes of real moments
          quantize(x * 1e-3, L, c1, q1, a1);
          quantize(x.square() * 1e-6, L, c2, q2, a2);
          quantize(x, L, c1, qm, am);
        }
        const double tq = median_seconds(reps, [&] { quantize(x, L, c1, q, a); });
        const double td = median_seconds(reps, [&] { dequantize(q, a, L, c1, out); });
        const double t8 = median_seconds(reps, [&] {
          adamw8bit_step(p, g, q1, a1, q2, a2, L, c1, c2, {1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, 1});
        });
        const double tm8 = median_seconds(reps, [&] {
          momentum8bit_step(g, qm, am, L, c1, 0.95f, true, qm2, am2, u);
        });
        // torch's fused step again beside each row (the machine may be shared)
        const double ttr = median_seconds(reps, [&] {
          at::_fused_adamw_({tp}, {g}, {tm}, {tv}, {}, {steps}, 1e-3, 0.9, 0.999, 0.01, 1e-8, false, false);
        });
        std::printf("%-7s %-9s %-4s | %8.2f %6.2f | %8.2f %6.2f | %8.2f %8.2f %7.2f | %8.2f %6.2f\n",
                    (std::to_string(mi) + "M").c_str(), path.name, fp8 ? "fp8" : "dyn", tq * 1e3,
                    mq / tq, td * 1e3, mq / td, t8 * 1e3, ttr * 1e3, t8 / ttr, tm8 * 1e3, mm / tm8);
      }
    }
    use_device_generic_path(false);
  }

  // Quantised eigenbases (SOAP's basis_dtype int8 / int4): what a step pays to use one n x n
  // basis (dequantise + one Björck step, 4 n^3 flops) beside the rotation it serves (two n x n
  // products of a square tile, 4 n^3 flops) and the eigh a first basis costs.
  std::printf("\n%-6s | %10s %10s %12s | %10s %10s\n", "n", "int8 ms", "int4 ms", "Björck GFLOP/s",
              "rotate ms", "eigh ms");
  for (int64_t n : {128, 256, 512, 1024}) {
    const at::Tensor qf = std::get<0>(at::linalg_qr(at::randn({n, n})));
    double t[2];
    for (int k = 0; k < 2; ++k) {
      const int bits = k == 0 ? 8 : 4;
      const at::Tensor map = lowbit_map("linear_square", bits);
      at::Tensor codes = at::empty({lowbit_code_bytes(n * n, bits)}, at::kByte);
      at::Tensor am = at::empty({lowbit_blocks(n * n, 64)});
      lowbit_quantize(qf, map, bits, 64, codes, am);
      t[k] = median_seconds(reps, [&] {
        bjorck(lowbit_dequantize(codes, am, map, bits, 64, n * n).view({n, n}), 1);
      });
    }
    const at::Tensor x = at::randn({n, n});
    const double tr = median_seconds(reps, [&] { at::mm(at::mm(qf.t(), x), qf); });
    const at::Tensor sym = at::mm(x, x.t());
    const double te = median_seconds(std::min(reps, 3), [&] { at::linalg_eigh(sym); });
    std::printf("%-6lld | %10.3f %10.3f %12.1f | %10.3f %10.2f\n", static_cast<long long>(n),
                t[0] * 1e3, t[1] * 1e3, 4.0 * n * n * n / t[0] / 1e9, tr * 1e3, te * 1e3);
  }
  return 0;
}
