// CodeLut: a 256-value code with its nearest-code lookup table, the one thing
// every quantisation kernel (portable, AVX-512, CUDA) needs of a code.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "quant/formats/code_index.h"

namespace rfsdp::quant::cpu {

// A sorted 256-value code with a lookup table for nearest-code search: the
// sign, the exponent (clamped to the 32 binades below 2) and the top 7 mantissa
// bits of a float pick a candidate, one compare against the midpoint to the next
// code decides. 8 KiB, so it stays in L1. Built once per code and rounding.
//
// keep_nonzero (codes whose smallest value is 0: the unsigned maps): a value
// above 0 never takes the code 0 (it rounds to code 1 at least; 0 stays 0).
// Adam's second moment needs it: a v stored as 0 beside a non-zero m turns
// m / (sqrt(v) + eps) into a step of m / eps (the "zero-point problem" of
// low-bit second moments). Every kernel reads the rule from the midpoints: mid[0]
// is 0 instead of code[1] / 2.
class CodeLut {
 public:
  explicit CodeLut(const float* code256, bool keep_nonzero = false);
  bool keep_nonzero() const { return keep_nonzero_; }
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
  // For kernels that gather (AVX2): a float's slot entry by its top 16 bits (sign,
  // exponent, 7 mantissa bits: the key before its binade is clamped), so the slot
  // costs one shift; 65536 int32 (256 KiB), of which data touch the few binades
  // they span. An entry is slot_mid's bits with the low 8 replaced by table()'s
  // entry t: compared with that truncated midpoint a value decides as with mid()[t]
  // unless its top 24 bits equal the entry's (within 255 ulps of it), the one case
  // that needs mid()[t] itself.
  const int32_t* entry_by_top16() const { return entry_by_top16_.data(); }
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
  float mid_[256];  // mid_[i] = (code[i] + code[i+1]) / 2 (keep_nonzero: mid_[0] = 0); mid_[255] = +inf
  std::vector<uint8_t> table_;
  std::vector<int32_t> entry_by_top16_;
  std::vector<float> slot_mid_;
  bool exact_ = true;
  bool keep_nonzero_ = false;
  std::optional<CodeIndex> index_;
  alignas(64) uint8_t code_planes_[4 * 256];
  alignas(64) uint8_t index_mid_planes_[4 * 256];
};

inline uint8_t CodeLut::nearest(float v) const {
  if (!exact_) return nearest_by_search(v);
  const uint32_t k = key(v);
  return static_cast<uint8_t>(table_[k] + (v > slot_mid_[k]));
}

}  // namespace rfsdp::quant::cpu
