// Runs a test body once per CPU kernel set this machine has (portable, and
// AVX2 and AVX-512 where present), switching back to the default afterwards.
#pragma once

#include <gtest/gtest.h>

#include <vector>

#include "quant/kernels/cpu/gathers.h"
#include "quant/kernels/cpu/kernels.h"

namespace rfsdp::testing {

inline std::vector<quant::cpu::Isa> quant_isas() {
  std::vector<quant::cpu::Isa> v = {quant::cpu::Isa::kPortable};
  for (quant::cpu::Isa isa : {quant::cpu::Isa::kAvx2, quant::cpu::Isa::kAvx512}) {
    if (quant::cpu::isa_supported(isa)) v.push_back(isa);
  }
  return v;
}

// AVX-512 twice: encoding with the code table's gathers and without (cpu/gathers.h),
// whichever this CPU's default.
template <class F>
void for_each_quant_isa(F&& body) {
  const quant::cpu::Isa before = quant::cpu::active_isa();
  const bool gathers_before = quant::cpu::gathers_used();
  for (quant::cpu::Isa isa : quant_isas()) {
    for (bool gathers : {true, false}) {
      if (!gathers && isa != quant::cpu::Isa::kAvx512) continue;
      const bool avx512 = isa == quant::cpu::Isa::kAvx512;
      SCOPED_TRACE(std::string("kernels: ") + quant::cpu::isa_name(isa) +
                   (avx512 ? (gathers ? " (gathers)" : " (shuffles only)") : ""));
      quant::cpu::use_isa(isa);
      quant::cpu::use_gathers(gathers);
      body(isa);
      quant::cpu::use_isa(before);
      quant::cpu::use_gathers(gathers_before);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

}  // namespace rfsdp::testing
