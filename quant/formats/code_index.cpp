#include "quant/formats/code_index.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace rfsdp::quant {

namespace {

constexpr uint32_t kNoBoundary = 0x7FC00000u;  // a quiet NaN: w >= it is false

// Floats in order as integers: +0 and -0 are both 0.
int64_t ord(float x) {
  const uint32_t b = CodeIndex::bits(x);
  return (b >> 31) ? -static_cast<int64_t>(b & 0x7FFFFFFFu) : static_cast<int64_t>(b);
}
float from_ord(int64_t o) {
  return o >= 0 ? CodeIndex::from_bits(static_cast<uint32_t>(o))
                : CodeIndex::from_bits(0x80000000u | static_cast<uint32_t>(-o));
}

CodeIndex empty_index(bool fold, float lo) {
  CodeIndex ix;
  ix.fold = fold;
  ix.lo = lo;
  std::fill(ix.binade_key, ix.binade_key + 32, kNoBoundary);
  std::fill(ix.a, ix.a + 16, 1.0f);
  std::fill(ix.b, ix.b + 16, 0.0f);
  return ix;
}

// A level per decade: level l holds codes base(l) + j, j < k(l), at
// 10^(l-6) * (0.1 + 0.9 (j + 1/2) / k), so in [10^(l-7), 10^(l-6)].
CodeIndex decades(bool fold, int levels, int64_t (*k_of)(int), int64_t (*base_of)(int)) {
  CodeIndex ix = empty_index(fold, 0.0f);
  for (int l = 0; l < levels; ++l) {
    const double k = static_cast<double>(k_of(l)), scale = std::pow(10.0, l - 6);
    // position t = (w / scale - 0.1) k / 0.9 - 1/2; f = base + floor(t)
    ix.a[l] = static_cast<float>(k / (0.9 * scale));
    ix.b[l] = static_cast<float>(0.1 * k / 0.9 + 0.5 - static_cast<double>(base_of(l)));
  }
  for (uint32_t bin = 0; bin < 32; ++bin) {
    const uint32_t e = CodeIndex::kLowestBinade + bin;
    const float start = bin == 0 ? 0.0f : CodeIndex::from_bits(e << 23);
    const float end = CodeIndex::from_bits((e + 1) << 23);
    uint32_t below = 0, key = kNoBoundary;
    for (int l = 0; l + 1 < levels; ++l) {
      const float top = static_cast<float>(std::pow(10.0, l - 6));  // level l's upper end
      if (top <= start) ++below;
      else if (top < end) key = CodeIndex::bits(top);
    }
    ix.binade_key[bin] = (key & ~15u) | below;
  }
  return ix;
}

CodeIndex linear(const float* code) {
  CodeIndex ix = empty_index(false, code[0]);
  const double step = (static_cast<double>(code[255]) - code[0]) / 255.0;
  ix.a[0] = static_cast<float>(1.0 / step);
  ix.b[0] = static_cast<float>(code[0] / step);
  return ix;
}

// Smallest i with v <= mid[i]: the nearest code, ties to the lower.
int32_t search(const float* mid, float v) {
  int lo = 0, hi = 255;
  while (lo < hi) {
    const int m = (lo + hi) / 2;
    if (v <= mid[m]) hi = m; else lo = m + 1;
  }
  return lo;
}

// The last o in [lo, hi] with f(o) == f(lo), for f monotone on [lo, hi].
template <class F>
int64_t last_equal(int64_t lo, int64_t hi, F&& f) {
  const auto target = f(lo);
  while (lo < hi) {
    const int64_t m = lo + (hi - lo + 1) / 2;
    if (f(m) == target) lo = m; else hi = m - 1;
  }
  return lo;
}

// Whether ix.nearest(v) == search(v) for every float v in (-2, 2). Where the
// level is fixed, the candidate is monotone in w, so constant on intervals that
// bisection finds; on such an interval nearest() is monotone with at most one
// step (one midpoint compare), and the search is monotone: equal at the ends and
// on both sides of that step, they are equal throughout.
bool exact(const CodeIndex& ix, const float* code, const float* mid) {
  for (int i = 0; i < 256; ++i) {
    if (!std::isfinite(code[i]) || (i > 0 && !(code[i - 1] < code[i]))) return false;
  }
  for (int l = 0; l < 16; ++l) {
    if (!(ix.a[l] > 0.0f) || !std::isfinite(ix.a[l]) || !std::isfinite(ix.b[l])) return false;
  }
  if (ix.fold) {
    for (int i = 127; i <= 254; ++i) {
      if (code[254 - i] != -code[i]) return false;
    }
    if (!(mid[127] > 0.0f)) return false;
  } else if (ix.lo != code[0]) {  // below lo: w = lo, the search says 0 as at lo
    return false;
  }
  const int64_t first = ix.fold ? 0 : ord(ix.lo), last = ord(2.0f) - 1;
  // Where the level may change: binade edges, decade boundaries, zero.
  std::vector<int64_t> cuts = {first, 0, last + 1};
  for (uint32_t e = CodeIndex::kLowestBinade; e <= CodeIndex::kLowestBinade + 32; ++e) {
    const float x = CodeIndex::from_bits(e << 23);
    cuts.insert(cuts.end(), {ord(x), ord(x) + 1, ord(-x), ord(-x) + 1});
  }
  for (uint32_t key : ix.binade_key) {
    const float t = CodeIndex::from_bits(key);
    if (std::isfinite(t)) cuts.insert(cuts.end(), {ord(t), ord(t) + 1, ord(-t), ord(-t) + 1});
  }
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  for (size_t c = 0; c + 1 < cuts.size(); ++c) {
    const int64_t s = std::max(cuts[c], first), e = std::min(cuts[c + 1] - 1, last);
    for (int64_t cur = s; cur <= e;) {
      const int64_t end = last_equal(cur, e, [&](int64_t o) {
        return ix.candidate(ix.index_value(from_ord(o)));
      });
      for (int sign = 0; sign < (ix.fold ? 2 : 1); ++sign) {
        auto value = [&](int64_t o) { return sign ? -from_ord(o) : from_ord(o); };
        auto got = [&](int64_t o) { return ix.nearest(value(o), mid); };
        const int64_t step = last_equal(cur, end, got);
        for (int64_t o : {cur, step, std::min(step + 1, end), end}) {
          if (got(o) != search(mid, value(o))) return false;
        }
      }
      cur = end + 1;
    }
  }
  return true;
}

}  // namespace

std::optional<CodeIndex> arithmetic_index(const float* code, const float* mid) {
  const CodeIndex tries[] = {
      decades(true, 7, [](int l) { return int64_t{1} << l; },
              [](int l) { return 127 + (int64_t{1} << l); }),  // dynamic, signed
      decades(false, 7, [](int l) { return int64_t{2} << l; },
              [](int l) { return (int64_t{2} << l) - 1; }),  // dynamic, unsigned
      linear(code)};
  for (const CodeIndex& ix : tries) {
    if (exact(ix, code, mid)) return ix;
  }
  return std::nullopt;
}

}  // namespace rfsdp::quant
