// Small integer helpers shared by the planner, the validator and the benches.
#pragma once

#include <cstdint>
#include <numeric>
#include <optional>

namespace rfsdp {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// lcm that saturates at `cap` instead of overflowing.
inline int64_t lcm_capped(int64_t a, int64_t b, int64_t cap) {
  const int64_t g = std::gcd(a, b);
  const int64_t a_over_g = a / g;
  if (a_over_g > cap / b) return cap;
  const int64_t l = a_over_g * b;
  return l > cap ? cap : l;
}

// a * b and a + b, or nothing where the result does not fit int64.
inline std::optional<int64_t> mul_checked(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}
inline std::optional<int64_t> add_checked(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

}  // namespace rfsdp
