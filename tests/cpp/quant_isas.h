// Runs a test body once per CPU kernel set this machine has (portable, and
// AVX-512 where present), switching back to the default afterwards.
#pragma once

#include <gtest/gtest.h>

#include <vector>

#include "quant/blockwise/cpu_kernels.h"

namespace rfsdp::testing {

inline std::vector<quant::cpu::Isa> quant_isas() {
  std::vector<quant::cpu::Isa> v = {quant::cpu::Isa::kPortable};
  if (quant::cpu::isa_supported(quant::cpu::Isa::kAvx512)) v.push_back(quant::cpu::Isa::kAvx512);
  return v;
}

template <class F>
void for_each_quant_isa(F&& body) {
  const quant::cpu::Isa before = quant::cpu::active_isa();
  for (quant::cpu::Isa isa : quant_isas()) {
    SCOPED_TRACE(std::string("kernels: ") + quant::cpu::isa_name(isa));
    quant::cpu::use_isa(isa);
    body(isa);
    quant::cpu::use_isa(before);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

}  // namespace rfsdp::testing
