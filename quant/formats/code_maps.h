// The 8-bit code maps: 256 sorted float32 values in [-1, 1] (or [0, 1]).
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>

#include "quant/formats/code_lut.h"

namespace rfsdp::quant {

// bitsandbytes' "dynamic" map (create_dynamic_map(signed, max_exponent_bits=7,
// total_bits=8)), computed with the same float32 tensor operations.
at::Tensor dynamic_map(bool is_signed);
// linspace(-1, 1, 256) when signed, linspace(0, 1, 256) otherwise.
at::Tensor linear_map(bool is_signed);
// "dynamic" or "linear"; throws for another name.
at::Tensor code_map(const std::string& name, bool is_signed);

// How an optimizer's 8-bit states are coded: the dynamic map (code_lut.h; the
// default, bitsandbytes' numerics) or float8_e4m3fn (fp8_e4m3.h). Names as
// Python spells them: "dynamic", "float8_e4m3fn".
enum class StateFormat { kDynamic, kFloat8E4M3 };
StateFormat state_format(const std::string& name);  // throws for another name
const char* state_format_name(StateFormat f);

// The nearest-code table of a code, built once per distinct code (and
// keep_nonzero: see CodeLut) and shared.
std::shared_ptr<const cpu::CodeLut> code_lut(const at::Tensor& code, bool keep_nonzero = false);

}  // namespace rfsdp::quant
