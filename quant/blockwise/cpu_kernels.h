// CPU kernels of block-wise 8-bit quantisation, over raw pointers. Threads
// run over blocks (ATen's pool). Two implementations, picked at run time:
// AVX-512 (F, BW, VBMI: cpu_kernels_avx512.cpp) where the CPU has it, and a
// portable one (its loops compiled for AVX2 and a baseline, picked at load time).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "quant/blockwise/adamw_update.h"
#include "quant/blockwise/block_layout.h"
#include "quant/blockwise/code_index.h"

namespace rfsdp::quant::cpu {

// A sorted 256-value code with a lookup table for nearest-code search: the
// sign, the exponent (clamped to the 32 binades below 2) and the top 7 mantissa
// bits of a float pick a candidate, one compare against the midpoint to the next
// code decides. 8 KiB, so it stays in L1. Built once per code.
class CodeLut {
 public:
  explicit CodeLut(const float* code256);
  const float* code() const { return code_; }
  const float* mid() const { return mid_; }
  // The arithmetic index (code_index.h), proven exact for this code; null if none.
  const CodeIndex* index() const { return index_ ? &*index_ : nullptr; }
  // Byte planes for lookups in vector registers: plane k, entry i is byte k of
  // code[i] (code_planes) or of the midpoint the index compares against for the
  // candidate i (index_mid_planes: mid[index()->mid_slot(i)]).
  const uint8_t* code_planes() const { return code_planes_; }
  const uint8_t* index_mid_planes() const { return index_mid_planes_; }
  const uint8_t* table() const { return table_.data(); }
  // slot_mid()[slot] == mid()[table()[slot]]: the compare needs no dependent load.
  const float* slot_mid() const { return slot_mid_.data(); }
  // Index of the code value nearest to v (ties to the lower index).
  inline uint8_t nearest(float v) const;
  uint8_t nearest_by_search(float v) const;  // binary search; the reference for the table
  bool table_exact() const { return exact_; }

  // Table slot of v: sign, binade (exponents 97..127 -> 1..31; smaller -> 0), 7 mantissa bits.
  static inline uint32_t key(float v) {
    uint32_t bits;
    __builtin_memcpy(&bits, &v, 4);
    const int32_t e = static_cast<int32_t>((bits >> 23) & 0xFF) - 96;
    const uint32_t binade = e < 0 ? 0u : (e > 31 ? 31u : static_cast<uint32_t>(e));
    return ((bits >> 31) << 12) | (binade << 7) | ((bits >> 16) & 0x7F);
  }

 private:
  float code_[256];
  float mid_[256];  // mid_[i] = (code[i] + code[i+1]) / 2; mid_[255] = +inf
  std::vector<uint8_t> table_;
  std::vector<float> slot_mid_;
  bool exact_ = true;
  std::optional<CodeIndex> index_;
  alignas(64) uint8_t code_planes_[4 * 256];
  alignas(64) uint8_t index_mid_planes_[4 * 256];
};

// The kernels in use. Default: the best this CPU runs, unless the environment
// sets RFSDP_QUANT_ISA=portable. use_isa switches (tests, benches); it throws
// std::invalid_argument for kernels this CPU cannot run.
enum class Isa { kPortable, kAvx512 };
Isa active_isa();
bool isa_supported(Isa isa);
void use_isa(Isa isa);
const char* isa_name(Isa isa);

inline uint8_t CodeLut::nearest(float v) const {
  if (!exact_) return nearest_by_search(v);
  const uint32_t k = key(v);
  return static_cast<uint8_t>(table_[k] + (v > slot_mid_[k]));
}

// Quantises x (laid out as `layout`) into q (one byte per element) and absmax
// (one per block). Returns false if x holds NaN or Inf (the outputs are then
// written but meaningless).
bool quantize(const float* x, const BlockLayout& layout, const CodeLut& lut, uint8_t* q,
              float* absmax);

void dequantize(const uint8_t* q, const float* absmax, const BlockLayout& layout,
                const CodeLut& lut, float* out);

// One AdamW step with 8-bit block-wise moments, fused: per block, read the
// codes, the gradient and the parameter once, update in fp32, write back.
void adamw8bit_step(float* param, const float* grad, uint8_t* q1, float* absmax1, uint8_t* q2,
                    float* absmax2, const BlockLayout& layout, const CodeLut& lut1,
                    const CodeLut& lut2, const AdamWHyper& h);

// One AdamW step with fp32 moments (the baseline), torch.optim.AdamW's formula.
void adamw32_step(float* param, const float* grad, float* m, float* v, int64_t n,
                  const AdamWHyper& h);

}  // namespace rfsdp::quant::cpu
