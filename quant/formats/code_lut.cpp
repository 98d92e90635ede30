#include "quant/formats/code_lut.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace rfsdp::quant::cpu {

namespace {

float bits_to_float(uint32_t b) {
  float f;
  __builtin_memcpy(&f, &b, 4);
  return f;
}

}  // namespace

CodeLut::CodeLut(const float* code256, bool keep_nonzero) : keep_nonzero_(keep_nonzero) {
  for (int i = 0; i < 256; ++i) code_[i] = code256[i];
  for (int i = 0; i < 255; ++i) {
    if (!(code_[i] <= code_[i + 1])) throw std::invalid_argument("a code must be sorted ascending");
  }
  if (keep_nonzero && (code_[0] != 0.0f || !(code_[1] > 0.0f))) {
    throw std::invalid_argument("keep_nonzero rounding needs a code whose smallest value is 0 "
                                "(an unsigned map)");
  }
  for (int i = 0; i < 256; ++i) mid_[i] = code_midpoint(code_, i, keep_nonzero);
  // Each slot covers a value range; its entry is the nearest index at the
  // range's lower end. Exact when no range crosses two midpoints.
  table_.resize(8192);
  for (uint32_t slot = 0; slot < 8192; ++slot) {
    const uint32_t sign = slot >> 12, binade = (slot >> 7) & 31, mant = slot & 0x7F;
    // Magnitudes of the range: binade 0 also holds everything smaller, down to 0.
    const float lo_mag =
        binade == 0 ? 0.0f : bits_to_float(((binade + 96) << 23) | (mant << 16));
    const float hi_mag = bits_to_float((((binade == 0 ? 96u : binade + 96) << 23) | (mant << 16)) |
                                       0xFFFFu);
    float a = sign ? -hi_mag : lo_mag, b = sign ? -lo_mag : hi_mag;
    a = std::clamp(a, -1.0f, 1.0f);
    b = std::clamp(b, -1.0f, 1.0f);
    const uint8_t ia = nearest_by_search(a), ib = nearest_by_search(b);
    if (ib > ia + 1) exact_ = false;
    table_[slot] = ia;
  }
  slot_mid_.resize(8192);
  for (uint32_t slot = 0; slot < 8192; ++slot) slot_mid_[slot] = mid_[table_[slot]];
  entry_by_top16_.resize(65536);
  for (uint32_t top = 0; top < 65536; ++top) {
    const uint32_t slot = key(bits_to_float(top << 16));  // key reads only the top 16 bits
    uint32_t mid_bits;
    std::memcpy(&mid_bits, &slot_mid_[slot], 4);
    entry_by_top16_[top] = static_cast<int32_t>((mid_bits & ~0xFFu) | table_[slot]);
  }
  index_ = arithmetic_index(code_, mid_);
  for (int i = 0; i < 256; ++i) {
    const int m = index_ ? index_->mid_slot(i) : i;
    uint8_t c[4], d[4];
    std::memcpy(c, &code_[i], 4);
    std::memcpy(d, &mid_[m], 4);
    for (int k = 0; k < 4; ++k) {
      code_planes_[256 * k + i] = c[k];
      index_mid_planes_[256 * k + i] = d[k];
    }
  }
}

uint8_t CodeLut::nearest_by_search(float v) const {
  // Smallest i with v <= mid_[i]: ties go to the lower code.
  int lo = 0, hi = 255;
  while (lo < hi) {
    const int m = (lo + hi) / 2;
    if (v <= mid_[m]) hi = m; else lo = m + 1;
  }
  return static_cast<uint8_t>(lo);
}

}  // namespace rfsdp::quant::cpu
