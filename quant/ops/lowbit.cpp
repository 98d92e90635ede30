#include "quant/ops/lowbit.h"

#include <stdexcept>

#include "quant/formats/code_maps.h"

namespace rfsdp::quant {

at::Tensor lowbit_map(const std::string& name, int bits) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("low-bit codes have 4 or 8 bits");
  const int64_t k = int64_t{1} << bits;
  if (name == "dynamic") {
    if (bits != 8) throw std::invalid_argument("the dynamic map has 8 bits; at 4 use \"linear_square\"");
    return dynamic_map(true);
  }
  const at::Tensor x = at::linspace(-1.0, 1.0, k, at::kFloat);
  if (name == "linear") return x;
  if (name == "linear_square") return (x.sign() * x * x).contiguous();
  throw std::invalid_argument("unknown low-bit map '" + name +
                              "': use \"linear_square\", \"linear\" or \"dynamic\" (8 bits)");
}

void LowBitFormat::check(const std::string& who) const {
  if (!coded()) return;
  if (bits != 4 && bits != 8) {
    throw std::invalid_argument(who + ": basis_dtype must be \"int8\" or \"int4\" (" +
                                std::to_string(bits) + " bits)");
  }
  if (map != "linear_square" && map != "linear" && !(map == "dynamic" && bits == 8)) {
    throw std::invalid_argument(who + ": basis_map must be \"linear_square\", \"linear\" or "
                                "\"dynamic\" (int8 only), got \"" + map + "\" at " +
                                std::to_string(bits) + " bits");
  }
  if (block < 1) {
    throw std::invalid_argument(who + ": basis_block must be an integer >= 1, got " +
                                std::to_string(block));
  }
  if (bjorck_iterations < 0) {
    throw std::invalid_argument(who + ": bjorck_iterations must be an integer >= 0, got " +
                                std::to_string(bjorck_iterations));
  }
}

int64_t lowbit_blocks(int64_t n, int64_t block) { return (n + block - 1) / block; }

int64_t lowbit_code_bytes(int64_t n, int bits) { return bits == 4 ? (n + 1) / 2 : n; }

void lowbit_quantize(const at::Tensor& x, const at::Tensor& map, int bits, int64_t block,
                     at::Tensor codes, at::Tensor absmax) {
  const int64_t n = x.numel(), nb = lowbit_blocks(n, block);
  at::Tensor xb = at::zeros({nb * block}, x.options().dtype(at::kFloat));
  xb.narrow(0, 0, n).copy_(x.reshape(-1));
  xb = xb.view({nb, block});
  const at::Tensor amax = xb.abs().amax(1);
  const at::Tensor scale = at::where(amax > 0, amax.reciprocal(), at::zeros_like(amax));
  const at::Tensor mids = (map.narrow(0, 1, map.numel() - 1) + map.narrow(0, 0, map.numel() - 1)) / 2;
  // bucketize: i with mids[i-1] < y <= mids[i], the nearest code with ties to the lower.
  at::Tensor idx = at::bucketize(xb * scale.unsqueeze(1), mids).reshape(-1).narrow(0, 0, n);
  absmax.copy_(amax);
  if (bits == 8) {
    codes.copy_(idx.to(at::kByte));
    return;
  }
  if (n % 2) idx = at::cat({idx, at::zeros({1}, idx.options())});
  const at::Tensor pairs = idx.view({-1, 2});
  codes.copy_((pairs.select(1, 0) + pairs.select(1, 1) * 16).to(at::kByte));
}

at::Tensor lowbit_dequantize(const at::Tensor& codes, const at::Tensor& absmax,
                             const at::Tensor& map, int bits, int64_t block, int64_t n) {
  at::Tensor idx = codes.to(at::kLong);
  if (bits == 4) idx = at::stack({idx.remainder(16), idx.div(16, "floor")}, 1).reshape(-1);
  idx = idx.narrow(0, 0, n);
  const at::Tensor scale = absmax.repeat_interleave(block).narrow(0, 0, n);
  return map.index_select(0, idx) * scale;
}

at::Tensor bjorck(at::Tensor v, int iterations) {
  for (int k = 0; k < iterations; ++k) v = 1.5 * v - 0.5 * at::mm(v, at::mm(v.t(), v));
  return v;
}

LowbitSquares::LowbitSquares(const std::vector<int64_t>& sizes, const LowBitFormat& format,
                             at::TensorOptions on)
    : n_(sizes), bits_(format.bits), iterations_(format.bjorck_iterations), block_(format.block) {
  format.check("low-bit bases");
  if (!format.coded()) throw std::invalid_argument("low-bit bases: no bits given");
  map_ = lowbit_map(format.map, bits_).to(on.device());
  int64_t codes = 0, blocks = 0;
  for (int64_t n : n_) {
    code_at_.push_back(codes);
    absmax_at_.push_back(blocks);
    codes += lowbit_code_bytes(n * n, bits_);
    blocks += lowbit_blocks(n * n, block_);
  }
  codes_ = at::zeros({codes}, on.dtype(at::kByte));
  absmax_ = at::zeros({blocks}, on.dtype(at::kFloat));
}

void LowbitSquares::store(size_t k, const at::Tensor& q) {
  const int64_t n = n_.at(k);
  lowbit_quantize(q.to(at::kFloat), map_, bits_, block_,
                  codes_.narrow(0, code_at_[k], lowbit_code_bytes(n * n, bits_)),
                  absmax_.narrow(0, absmax_at_[k], lowbit_blocks(n * n, block_)));
}

at::Tensor LowbitSquares::dequantized(size_t k) const {
  const int64_t n = n_.at(k);
  return lowbit_dequantize(codes_.narrow(0, code_at_[k], lowbit_code_bytes(n * n, bits_)),
                           absmax_.narrow(0, absmax_at_[k], lowbit_blocks(n * n, block_)), map_,
                           bits_, block_, n * n)
      .view({n, n});
}

at::Tensor LowbitSquares::orthogonal(size_t k) const { return bjorck(dequantized(k), iterations_); }

}  // namespace rfsdp::quant
