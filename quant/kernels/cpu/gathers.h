// Whether the AVX-512 kernels of the code maps (cpu/avx512.cpp) encode part of
// their chunks by the code table's gathers (CodeLut::entry_by_top16) beside the
// arithmetic index's shuffles, or by the index alone. Both give the same codes
// (the table is used only where it is exact, CodeLut::table_exact); only the speed
// differs, and it differs by CPU: on the Intel Xeon measured, the gathers
// overlapped the shuffles (as fast or faster); on AMD Zen 5 a 16-lane gather costs
// so much that the index alone runs the AdamW8bit step 1.6x faster (1 Mi elements:
// 1.05-1.12 -> 0.63-0.72 ms, bench/bench_quant.cpp; issue 57). Default: gathers on
// Intel CPUs only; RFSDP_QUANT_GATHERS=1 or =0 sets it either way (another value is
// an error at the first kernel that reads it), use_gathers switches it (the tests
// run both on every CPU). Here, not in kernels.h, so cpu/avx512.cpp reads it without depending
// on the dispatch above it.
#pragma once

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace rfsdp::quant::cpu {

inline bool gathers_by_default() {
  if (const char* env = std::getenv("RFSDP_QUANT_GATHERS")) {
    if (std::strcmp(env, "1") == 0) return true;
    if (std::strcmp(env, "0") == 0) return false;
    throw std::invalid_argument(std::string("RFSDP_QUANT_GATHERS is '") + env +
                                "': set it to 1 (the code table's gathers) or 0 (shuffles "
                                "only), or unset it (gathers on Intel CPUs)");
  }
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  return __builtin_cpu_is("intel");
#else
  return false;
#endif
}

inline std::atomic<bool>& gathers_setting() {
  static std::atomic<bool> on{gathers_by_default()};
  return on;
}
inline bool gathers_used() { return gathers_setting().load(std::memory_order_relaxed); }
inline void use_gathers(bool on) { gathers_setting().store(on, std::memory_order_relaxed); }

}  // namespace rfsdp::quant::cpu
