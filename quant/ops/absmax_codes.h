// Symmetric absmax block codes (the weights' all-gather under a CommPolicy,
// fsdp/quantized_gather.h): blocks of `block` consecutive elements, one fp32
// scale absmax / code_max each; int8 codes round(x / scale) (half to even)
// clamped to +-127; float8_e4m3fn codes (x / scale) clamped to +-448 and cast as
// torch casts (round to nearest even); a block of zeros has scale 0, codes 0.
// Decoded: code * scale in fp32, then the output dtype's rounding (nearest even).
// CPU kernels, bit for bit the ATen expressions fsdp/quantized_gather.cpp runs
// on other devices (tests compare them).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace rfsdp::quant::cpu {

enum class AbsmaxCode { kInt8, kFloat8E4M3FN };

// x: n fp32 elements; codes: n bytes (int8 or e4m3fn bits); scales: ceil(n / block).
void absmax_encode(const float* x, int64_t n, int64_t block, AbsmaxCode kind, uint8_t* codes,
                   float* scales);

// codes, scales as absmax_encode wrote them -> out (n elements of out_dtype:
// float32, bfloat16 or float16).
void absmax_decode(const uint8_t* codes, const float* scales, int64_t n, int64_t block,
                   AbsmaxCode kind, at::ScalarType out_dtype, void* out);

}  // namespace rfsdp::quant::cpu
