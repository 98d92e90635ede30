// The settings every tiled optimizer (Shampoo, SOAP) shares: how its matrices
// are cut into tiles, how often its amortised computation (inverse roots,
// eigenbases) runs, how its factors and low-bit bases are stored, and the
// NaN/Inf check. ShampooConfig and SOAPConfig derive from it and add their own.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "quant/ops.h"

namespace rfsdp {

struct TiledConfig {
  // precondition_frequency's default is each optimizer's (Shampoo 20, SOAP 10).
  explicit TiledConfig(int default_frequency) : precondition_frequency(default_frequency) {}
  // (polymorphic: requantized_own reads the derived optimizer's saved settings)
  virtual ~TiledConfig() = default;
  TiledConfig(const TiledConfig&) = default;
  TiledConfig& operator=(const TiledConfig&) = default;

  int64_t max_preconditioner_dim = 1024;  // B: tiles of at most B x B
  int precondition_frequency;             // steps between two amortised computations
  // Storage of the factors L, R (and of what is derived from them where the
  // optimizer says so): float32 or bfloat16; every step computes in fp32.
  at::ScalarType factor_dtype = at::kFloat;
  bool check_finite = true;  // NaN/Inf gradients: every rank throws
  // Coded (8 or 4 bits): each tile's n x n eigenvector matrix kept as block-wise
  // codes (LowbitSquares: blocks of it row by row, one fp32 absmax each),
  // dequantised and rectified by Björck steps wherever a step uses it.
  quant::LowBitFormat basis;

  // The settings (as Python names them) requantized_state moves between.
  static std::vector<std::string> requantizable() {
    return {"basis_dtype", "basis_block", "basis_map", "bjorck_iterations"};
  }
};

// Throws std::invalid_argument, naming `who` and the setting as Python names it,
// unless the shared settings of c are usable.
void check_tiled_config(const char* who, const TiledConfig& c);

}  // namespace rfsdp
