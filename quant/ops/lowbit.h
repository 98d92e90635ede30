// Low-bit (8- or 4-bit) block-wise codes of small fp32 tensors, in ATen ops
// (any device): what SOAP's and Shampoo's quantised eigenbases are stored as. Blocks are runs
// of `block` consecutive elements of the flat tensor, one fp32 absmax each;
// codes are the indices of the nearest map value (ties to the lower), one byte
// each at 8 bits, two to a byte at 4 bits (the even element in the low nibble).
// And the Björck iteration that rectifies a dequantised orthogonal matrix.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace rfsdp::quant {

// 2^bits sorted values in [-1, 1]: "linear_square" (sign(x) x^2 at x = -1 +
// 2k / (2^bits - 1), the 4-bit Shampoo paper's), "linear" (x itself), or
// "dynamic" (8 bits: bitsandbytes' signed dynamic map).
at::Tensor lowbit_map(const std::string& name, int bits);

// How the tiled optimizers store square matrices (eigenbases) in low-bit codes:
// 8 or 4 bits (0: not coded), blocks of `block` elements, the map (lowbit_map's
// names), and the Björck steps that rectify a decoded orthogonal matrix.
struct LowBitFormat {
  int bits = 0;
  int64_t block = 64;
  std::string map = "linear_square";
  int bjorck_iterations = 1;
  bool coded() const { return bits != 0; }
  // Throws std::invalid_argument, naming `who` and the settings as Python names
  // them (basis_dtype, basis_block, basis_map, bjorck_iterations), unless this is
  // a format: not coded, or 4 / 8 bits, block >= 1, a map of those bits, >= 0 steps.
  void check(const std::string& who) const;
  bool operator==(const LowBitFormat& o) const {
    return bits == o.bits && block == o.block && map == o.map &&
           bjorck_iterations == o.bjorck_iterations;
  }
};

int64_t lowbit_blocks(int64_t n, int64_t block);
int64_t lowbit_code_bytes(int64_t n, int bits);

// x (fp32, n elements) into codes (uint8, lowbit_code_bytes) and absmax (fp32,
// lowbit_blocks): views they write into. map on x's device.
void lowbit_quantize(const at::Tensor& x, const at::Tensor& map, int bits, int64_t block,
                     at::Tensor codes, at::Tensor absmax);

// The n fp32 values of codes and absmax.
at::Tensor lowbit_dequantize(const at::Tensor& codes, const at::Tensor& absmax,
                             const at::Tensor& map, int bits, int64_t block, int64_t n);

// Björck orthonormalisation of a square v: v <- 1.5 v - 0.5 v v^T v, `iterations` times.
at::Tensor bjorck(at::Tensor v, int iterations);

// Square fp32 matrices, each n_k x n_k (eigenbases: orthogonal), kept as low-bit
// codes: each matrix its own run of blocks of `block` elements, row by row (no
// block spans two matrices, so one's scales never depend on another's values).
// codes() and absmax() are the state a checkpoint saves and loads in place.
class LowbitSquares {
 public:
  LowbitSquares() = default;
  // The format's map kept on `on`'s device. Every code is 0 and
  // every absmax 0 (every matrix decodes to zeros) until stored.
  LowbitSquares(const std::vector<int64_t>& sizes, const LowBitFormat& format, at::TensorOptions on);
  bool defined() const { return codes_.defined(); }
  size_t size() const { return n_.size(); }
  // Matrix k from q (fp32, n_k x n_k).
  void store(size_t k, const at::Tensor& q);
  // Matrix k dequantised (fp32, n_k x n_k), and then rectified by Björck.
  at::Tensor dequantized(size_t k) const;
  at::Tensor orthogonal(size_t k) const;
  const at::Tensor& codes() const { return codes_; }
  const at::Tensor& absmax() const { return absmax_; }
  int64_t nbytes() const { return defined() ? codes_.nbytes() + absmax_.nbytes() : 0; }

 private:
  std::vector<int64_t> n_, code_at_, absmax_at_;
  int bits_ = 0, iterations_ = 0;
  int64_t block_ = 0;
  at::Tensor codes_, absmax_, map_;
};

}  // namespace rfsdp::quant
