#include "quant/ops/blockwise.h"

#include <stdexcept>

#include "quant/ops/state_ops.h"

namespace rfsdp::quant {

BlockLayout layout_of(const at::Tensor& x, BlockShape shape, int64_t row_len) {
  shape.check();
  const int64_t n = x.numel();
  if (row_len < 0) row_len = x.dim() >= 2 ? x.size(-1) : 1;
  if (row_len < 1 || (n > 0 && n % row_len != 0)) {
    throw std::invalid_argument("row_len " + std::to_string(row_len) + " does not divide the " +
                                std::to_string(n) + " elements");
  }
  return BlockLayout(shape, n / row_len, row_len);
}

namespace {

// torch's spelling of a dtype, for messages.
std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kByte: return "uint8";
    default: return c10::toString(t);
  }
}

// CPU tensors run the CPU kernels, CUDA tensors the CUDA kernels, other devices
// the device-generic path (state_ops.h); meta tensors hold no values.
void check_tensor(const at::Tensor& t, at::ScalarType dt, const char* what) {
  if (t.scalar_type() != dt) {
    throw std::invalid_argument(std::string(what) + " must be " + dtype_name(dt) + ", got " +
                                dtype_name(t.scalar_type()));
  }
  if (t.device().is_meta()) {
    throw std::invalid_argument(std::string(what) + " is on meta: block-wise quantisation runs "
                                "on tensors with values (the CPU, a CUDA device, or another "
                                "device through the device-generic path); meta tensors have none");
  }
}

void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* what) {
  if (t.device() != ref.device()) {
    throw std::invalid_argument(std::string(what) + " is on " + t.device().str() +
                                ", the codes on " + ref.device().str() + "; put both on one device");
  }
}

}  // namespace

Quantized quantize_blockwise(const at::Tensor& x_in, const at::Tensor& code, BlockShape shape,
                             int64_t row_len, bool keep_nonzero) {
  return quantize_blockwise(x_in, Codec(code, keep_nonzero), shape, row_len);
}

Quantized quantize_blockwise(const at::Tensor& x_in, const Codec& code, BlockShape shape,
                             int64_t row_len) {
  check_tensor(x_in, at::kFloat, "quantize_blockwise input");
  const at::Tensor x = x_in.contiguous();
  const BlockLayout L = layout_of(x, shape, row_len);
  Quantized q{at::empty(x.sizes(), x.options().dtype(at::kByte)),
              at::empty({L.num_blocks}, x.options())};
  if (!quant::quantize(x, L, code, q.codes, q.absmax)) {
    throw std::invalid_argument("quantize_blockwise: the input holds NaN or Inf values");
  }
  return q;
}

at::Tensor dequantize_blockwise(const Quantized& q, const at::Tensor& code, BlockShape shape,
                                int64_t row_len, const at::Tensor& out_in) {
  return dequantize_blockwise(q, Codec(code.to(at::kCPU, at::kFloat)), shape, row_len, out_in);
}

at::Tensor dequantize_blockwise(const Quantized& q, const Codec& code, BlockShape shape,
                                int64_t row_len, const at::Tensor& out_in) {
  check_tensor(q.codes, at::kByte, "dequantize_blockwise codes");
  check_tensor(q.absmax, at::kFloat, "dequantize_blockwise absmax");
  check_same_device(q.absmax, q.codes, "dequantize_blockwise absmax");
  const at::Tensor codes = q.codes.contiguous();
  const BlockLayout L = layout_of(codes, shape, row_len);
  if (q.absmax.numel() != L.num_blocks) {
    throw std::invalid_argument("dequantize_blockwise: " + std::to_string(q.absmax.numel()) +
                                " absmax values for " + std::to_string(L.num_blocks) + " blocks (" +
                                shape.str() + ")");
  }
  at::Tensor out = out_in;
  if (out.defined()) {
    check_tensor(out, at::kFloat, "dequantize_blockwise out");
    check_same_device(out, q.codes, "dequantize_blockwise out");
    if (!out.is_contiguous() || out.numel() != codes.numel()) {
      throw std::invalid_argument("dequantize_blockwise: out must be contiguous with " +
                                  std::to_string(codes.numel()) + " elements, got " +
                                  std::to_string(out.numel()) +
                                  (out.is_contiguous() ? "" : " (not contiguous)"));
    }
  } else {
    out = at::empty(codes.sizes(), codes.options().dtype(at::kFloat));
  }
  quant::dequantize(codes, q.absmax.contiguous(), L, code, out);
  return out;
}

}  // namespace rfsdp::quant
