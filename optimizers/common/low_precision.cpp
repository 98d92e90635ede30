#include "optimizers/common/low_precision.h"

#include <algorithm>
#include <stdexcept>

namespace rfsdp {

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

at::Tensor shr(const at::Tensor& x, int64_t n) { return x.bitwise_right_shift(n); }
at::Tensor shl(const at::Tensor& x, int64_t n) { return x.bitwise_left_shift(n); }

// x * c mod 2^32, for int64 tensors holding values below 2^32: c in 16-bit
// halves, so no product leaves int64's range (below 2^49).
at::Tensor mul32(const at::Tensor& x, uint32_t c) {
  const int64_t lo = c & 0xFFFF, hi = c >> 16;
  return (x * lo + shl((x * hi).bitwise_and(0xFFFF), 16)).bitwise_and(0xFFFFFFFF);
}

// A 32-bit integer hash (lowbias32) of every element.
at::Tensor hash32(at::Tensor x) {
  x = x.bitwise_xor(shr(x, 16));
  x = mul32(x, 0x7feb352dU);
  x = x.bitwise_xor(shr(x, 15));
  x = mul32(x, 0x846ca68bU);
  return x.bitwise_xor(shr(x, 16));
}

constexpr int64_t kChunk = int64_t{1} << 20;  // elements a pass rounds at once (bounds temporaries)

}  // namespace

Rounding parse_rounding(const std::string& s) {
  if (s == "nearest") return Rounding::kNearest;
  if (s == "stochastic") return Rounding::kStochastic;
  throw std::invalid_argument("rounding must be \"nearest\" or \"stochastic\" (how a step writes "
                              "bfloat16 / float16 parameters back), got \"" + s + "\"");
}

bool is_parameter_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

bool is_low_precision(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

at::Tensor rounding_noise(uint64_t seed, uint64_t salt, int64_t counter, int64_t first, int64_t n,
                          const at::TensorOptions& on) {
  const uint64_t k = splitmix64(seed ^ splitmix64(salt ^ splitmix64(static_cast<uint64_t>(counter))));
  const int64_t k1 = static_cast<int64_t>(k & 0xFFFFFFFFULL), k2 = static_cast<int64_t>(k >> 32);
  const at::Tensor idx = at::arange(first, first + n, on.dtype(at::kLong));
  at::Tensor h = hash32(idx.bitwise_and(0xFFFFFFFF).bitwise_xor(k1));
  h = hash32(h.bitwise_xor(shr(idx, 32)).bitwise_xor(k2));
  return shr(h, 8).to(at::kFloat).mul_(1.0 / (1 << 24));
}

void round_into(const at::Tensor& dst, const at::Tensor& x, Rounding r, uint64_t seed,
                uint64_t salt, int64_t counter, int64_t first) {
  if (!is_low_precision(dst.scalar_type()) || x.scalar_type() != at::kFloat ||
      dst.numel() != x.numel() || !dst.is_contiguous() || !x.is_contiguous()) {
    throw std::invalid_argument("round_into: needs a contiguous bfloat16 or float16 destination "
                                "and as many contiguous float32 values");
  }
  const at::Tensor out = dst.view(-1), in = x.view(-1);
  if (r == Rounding::kNearest) {
    out.copy_(in);
    return;
  }
  const at::ScalarType dt = dst.scalar_type();
  for (int64_t a = 0; a < in.numel(); a += kChunk) {
    const int64_t len = std::min(kChunk, in.numel() - a);
    const at::Tensor xs = in.narrow(0, a, len);
    // y: the nearest value; z: its neighbour on x's other side (one unit in the
    // last place further from or nearer to 0: the formats are sign-magnitude, so
    // the bit pattern +-1). x becomes z with probability |x - y| / |z - y|.
    const at::Tensor y = xs.to(dt), yf = y.to(at::kFloat);
    const at::Tensor away = xs.abs() > yf.abs();
    const at::Tensor bits = y.view(at::kShort);
    const at::Tensor z = at::where(away, bits + 1, bits - 1).to(at::kShort).view(dt);
    const at::Tensor p = (xs - yf).div_(z.to(at::kFloat) - yf).abs_();
    const at::Tensor u = rounding_noise(seed, salt, counter, first + a, len, xs.options());
    const at::Tensor take_z = (yf != xs).logical_and_(u < p);
    out.narrow(0, a, len).copy_(at::where(take_z, z, y));
  }
}

}  // namespace rfsdp
