#include "quant/formats/code_maps.h"

#include <cmath>
#include <map>
#include <mutex>
#include <stdexcept>
#include <utility>
#include <vector>

namespace rfsdp::quant {

at::Tensor dynamic_map(bool is_signed) {
  // 7 exponent levels 10^-6 .. 10^0; level i holds the midpoints of
  // linspace(0.1, 1, k+1) with k = 2^i (signed, mirrored) or 2^(i+1) (unsigned),
  // then 0 and 1: 2*127 + 2 = 254 + 2 = 256 values.
  constexpr int kExponentBits = 7;
  std::vector<at::Tensor> parts;
  for (int i = 0; i < kExponentBits; ++i) {
    const int64_t items = is_signed ? (int64_t{1} << i) + 1 : (int64_t{1} << (i + 1)) + 1;
    const at::Tensor bounds = at::linspace(0.1, 1.0, items, at::kFloat);
    const at::Tensor means = (bounds.narrow(0, 0, items - 1) + bounds.narrow(0, 1, items - 1)) / 2.0;
    const at::Tensor level = means * std::pow(10.0, -(kExponentBits - 1) + i);
    parts.push_back(level);
    if (is_signed) parts.push_back(-level);
  }
  parts.push_back(at::zeros({1}, at::kFloat));
  parts.push_back(at::ones({1}, at::kFloat));
  at::Tensor data = std::get<0>(at::cat(parts).sort());
  TORCH_CHECK(data.numel() == 256, "dynamic map has ", data.numel(), " values");
  return data.contiguous();
}

at::Tensor linear_map(bool is_signed) {
  return at::linspace(is_signed ? -1.0 : 0.0, 1.0, 256, at::kFloat);
}

at::Tensor code_map(const std::string& name, bool is_signed) {
  if (name == "dynamic") return dynamic_map(is_signed);
  if (name == "linear") return linear_map(is_signed);
  throw std::invalid_argument("unknown code map '" + name + "': use \"dynamic\" or \"linear\"");
}

StateFormat state_format(const std::string& name) {
  if (name == "dynamic") return StateFormat::kDynamic;
  if (name == "float8_e4m3fn") return StateFormat::kFloat8E4M3;
  throw std::invalid_argument("unknown 8-bit state format '" + name +
                              "': use \"dynamic\" or \"float8_e4m3fn\"");
}

const char* state_format_name(StateFormat f) {
  return f == StateFormat::kFloat8E4M3 ? "float8_e4m3fn" : "dynamic";
}

std::shared_ptr<const cpu::CodeLut> code_lut(const at::Tensor& code, bool keep_nonzero) {
  if (code.numel() != 256 || code.scalar_type() != at::kFloat) {
    throw std::invalid_argument("a code map must be 256 float32 values, got " +
                                std::to_string(code.numel()) + " " +
                                std::string(c10::toString(code.scalar_type())));
  }
  const at::Tensor c = code.to(at::kCPU).contiguous();
  std::vector<float> key(c.data_ptr<float>(), c.data_ptr<float>() + 256);
  static std::mutex mu;
  static std::map<std::pair<std::vector<float>, bool>, std::shared_ptr<const cpu::CodeLut>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = cache[{key, keep_nonzero}];
  if (!slot) slot = std::make_shared<const cpu::CodeLut>(key.data(), keep_nonzero);
  return slot;
}

}  // namespace rfsdp::quant
