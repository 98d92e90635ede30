#include "quant/kernels/cuda/ops.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <stdexcept>
#include <string>

#if defined(RFSDP_WITH_CUDA_KERNELS)
#include "quant/kernels/cuda/kernels.h"
#endif

namespace rfsdp::quant::cuda_ops {

namespace {

void check(const at::Tensor& t, at::ScalarType dt, int64_t n, const at::Device& dev,
           const char* what) {
  if (!t.defined() || t.scalar_type() != dt || !t.is_contiguous() || t.device() != dev ||
      t.numel() != n) {
    throw std::invalid_argument(
        std::string(what) + ": expected a contiguous " + c10::toString(dt) + " tensor of " +
        std::to_string(n) + " elements on " + dev.str() + ", got " +
        (t.defined() ? std::to_string(t.numel()) + " " + c10::toString(t.scalar_type()) +
                           " elements on " + t.device().str()
                     : std::string("none")));
  }
}

void check_gpu(const at::Tensor& t, const char* what) {
  if (!t.device().is_cuda()) {
    throw std::invalid_argument(std::string(what) + " is on " + t.device().str() +
                                ": the CUDA kernels take CUDA tensors");
  }
}

}  // namespace

#if defined(RFSDP_WITH_CUDA_KERNELS)

namespace {

cudaStream_t current_stream(const at::Device& d) {
  return static_cast<cudaStream_t>(
      c10::impl::VirtualGuardImpl(d.type()).getStream(d).native_handle());
}

cuda::CodeRounding rounding_of(const cpu::CodeLut& lut) {
  return {lut.index(), lut.keep_nonzero()};
}

void launched(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": CUDA error: " + cudaGetErrorString(e));
  }
}

// The fused step's inputs (op names them in messages): a CUDA parameter, and every
// tensor on its device, of its dtype and size.
void check_step(const at::Tensor& p, const at::Tensor& g, const at::Tensor& q1,
                const at::Tensor& a1, const at::Tensor& q2, const at::Tensor& a2,
                const BlockLayout& L, const std::string& op) {
  check_gpu(p, (op + " param").c_str());
  const at::Device d = p.device();
  const int64_t n = L.numel;
  check(p, at::kFloat, n, d, (op + " param").c_str());
  check(g, at::kFloat, n, d, (op + " grad").c_str());
  check(q1, at::kByte, n, d, (op + " q1").c_str());
  check(q2, at::kByte, n, d, (op + " q2").c_str());
  check(a1, at::kFloat, L.num_blocks, d, (op + " absmax1").c_str());
  check(a2, at::kFloat, L.num_blocks, d, (op + " absmax2").c_str());
}

// The dynamic map's two code tensors.
void check_codes(const at::Tensor& code1, const at::Tensor& code2, const at::Device& d,
                 const std::string& op) {
  check(code1, at::kFloat, 256, d, (op + " code1").c_str());
  check(code2, at::kFloat, 256, d, (op + " code2").c_str());
}

// The first half's outputs: the moments of every block, this rank's maxima.
void check_begin(const at::Tensor& scratch, const at::Tensor& amax1, const at::Tensor& amax2,
                 const BlockLayout& L, const at::Device& d) {
  check(scratch, at::kFloat, 2 * L.num_blocks * L.max_block_elems(), d, "adamw8bit_begin scratch");
  check(amax1, at::kFloat, L.num_blocks, d, "adamw8bit_begin amax1");
  check(amax2, at::kFloat, L.num_blocks, d, "adamw8bit_begin amax2");
}

// The second half's inputs and outputs; returns the device (scratch's).
at::Device check_end(const at::Tensor& scratch, const at::Tensor& agreed1,
                     const at::Tensor& agreed2, const at::Tensor& q1, const at::Tensor& a1,
                     const at::Tensor& q2, const at::Tensor& a2, const BlockLayout& L) {
  const at::Device d = check_end(scratch, agreed1, agreed2, q1, a1, q2, a2, L);
  return d;
}

}  // namespace

bool built() { return true; }

void quantize(const at::Tensor& x, const BlockLayout& L, const at::Tensor& code,
              const cpu::CodeLut& lut, const at::Tensor& q, const at::Tensor& absmax) {
  check_gpu(x, "quantize input");
  const at::Device d = x.device();
  check(x, at::kFloat, L.rows * L.row_len, d, "quantize input");
  check(code, at::kFloat, 256, d, "quantize code");
  check(q, at::kByte, x.numel(), d, "quantize codes");
  check(absmax, at::kFloat, L.num_blocks, d, "quantize absmax");
  if (x.numel() == 0) return;
  c10::DeviceGuard guard(d);
  launched(cuda::quantize(x.data_ptr<float>(), L, code.data_ptr<float>(), rounding_of(lut),
                          q.data_ptr<uint8_t>(), absmax.data_ptr<float>(), current_stream(d)),
           "quantize");
}

void dequantize(const at::Tensor& q, const at::Tensor& absmax, const BlockLayout& L,
                const at::Tensor& code, const at::Tensor& out) {
  check_gpu(q, "dequantize codes");
  const at::Device d = q.device();
  check(q, at::kByte, L.rows * L.row_len, d, "dequantize codes");
  check(absmax, at::kFloat, L.num_blocks, d, "dequantize absmax");
  check(code, at::kFloat, 256, d, "dequantize code");
  check(out, at::kFloat, q.numel(), d, "dequantize out");
  if (q.numel() == 0) return;
  c10::DeviceGuard guard(d);
  launched(cuda::dequantize(q.data_ptr<uint8_t>(), absmax.data_ptr<float>(), L,
                            code.data_ptr<float>(), out.data_ptr<float>(), current_stream(d)),
           "dequantize");
}

void adamw8bit_step(const at::Tensor& p, const at::Tensor& g, const at::Tensor& q1,
                    const at::Tensor& a1, const at::Tensor& q2, const at::Tensor& a2,
                    const BlockLayout& L, const at::Tensor& code1, const cpu::CodeLut& lut1,
                    const at::Tensor& code2, const cpu::CodeLut& lut2, const AdamWHyper& h) {
  check_step(p, g, q1, a1, q2, a2, L, "adamw8bit");
  const at::Device d = p.device();
  check_codes(code1, code2, d, "adamw8bit");
  if (L.numel == 0) return;
  c10::DeviceGuard guard(d);
  launched(cuda::adamw8bit_step(p.data_ptr<float>(), g.data_ptr<float>(), q1.data_ptr<uint8_t>(),
                                a1.data_ptr<float>(), q2.data_ptr<uint8_t>(), a2.data_ptr<float>(),
                                L, code1.data_ptr<float>(), rounding_of(lut1), code2.data_ptr<float>(),
                                rounding_of(lut2), h, current_stream(d)),
           "adamw8bit_step");
}

void adamw8bit_begin(const at::Tensor& p, const at::Tensor& g, const at::Tensor& q1,
                     const at::Tensor& a1, const at::Tensor& q2, const at::Tensor& a2,
                     const BlockLayout& L, const at::Tensor& code1, const at::Tensor& code2,
                     const AdamWHyper& h, const at::Tensor& scratch, const at::Tensor& amax1,
                     const at::Tensor& amax2) {
  check_step(p, g, q1, a1, q2, a2, L, "adamw8bit_begin");
  const at::Device d = p.device();
  check_codes(code1, code2, d, "adamw8bit_begin");
  check_begin(scratch, amax1, amax2, L, d);
  if (L.numel == 0) return;
  c10::DeviceGuard guard(d);
  launched(cuda::adamw8bit_begin(p.data_ptr<float>(), g.data_ptr<float>(), q1.data_ptr<uint8_t>(),
                                 a1.data_ptr<float>(), q2.data_ptr<uint8_t>(), a2.data_ptr<float>(),
                                 L, code1.data_ptr<float>(), code2.data_ptr<float>(), h,
                                 scratch.data_ptr<float>(), amax1.data_ptr<float>(),
                                 amax2.data_ptr<float>(), current_stream(d)),
           "adamw8bit_begin");
}

void adamw8bit_end(const at::Tensor& scratch, const BlockLayout& L, const at::Tensor& code1,
                   const cpu::CodeLut& lut1, const at::Tensor& code2, const cpu::CodeLut& lut2,
                   const at::Tensor& agreed1, const at::Tensor& agreed2, const at::Tensor& q1,
                   const at::Tensor& a1, const at::Tensor& q2, const at::Tensor& a2) {
  const at::Device d = check_end(scratch, agreed1, agreed2, q1, a1, q2, a2, L);
  check_codes(code1, code2, d, "adamw8bit_end");
  if (L.numel == 0) return;
  c10::DeviceGuard guard(d);
  launched(cuda::adamw8bit_end(scratch.data_ptr<float>(), L, code1.data_ptr<float>(),
                               rounding_of(lut1), code2.data_ptr<float>(), rounding_of(lut2),
                               agreed1.data_ptr<float>(), agreed2.data_ptr<float>(),
                               q1.data_ptr<uint8_t>(), a1.data_ptr<float>(), q2.data_ptr<uint8_t>(),
                               a2.data_ptr<float>(), current_stream(d)),
           "adamw8bit_end");
}

// The float8 operations: the same checks (the code tensors aside).
void quantize_fp8(const at::Tensor& x, const BlockLayout& L, bool keep_nonzero,
                  const at::Tensor& q, const at::Tensor& absmax) {
  check_gpu(x, "quantize input");
  const at::Device d = x.device();
  check(x, at::kFloat, L.numel, d, "quantize input");
  check(q, at::kByte, L.numel, d, "quantize codes");
  check(absmax, at::kFloat, L.num_blocks, d, "quantize absmax");
  if (L.numel == 0) return;
  c10::DeviceGuard guard(d);
  launched(cuda::quantize_fp8(x.data_ptr<float>(), L, keep_nonzero, q.data_ptr<uint8_t>(),
                              absmax.data_ptr<float>(), current_stream(d)),
           "quantize (float8_e4m3fn)");
}

void dequantize_fp8(const at::Tensor& q, const at::Tensor& absmax, const BlockLayout& L,
                    const at::Tensor& out) {
  check_gpu(q, "dequantize codes");
  const at::Device d = q.device();
  check(q, at::kByte, L.numel, d, "dequantize codes");
  check(absmax, at::kFloat, L.num_blocks, d, "dequantize absmax");
  check(out, at::kFloat, L.numel, d, "dequantize out");
  if (L.numel == 0) return;
  c10::DeviceGuard guard(d);
  launched(cuda::dequantize_fp8(q.data_ptr<uint8_t>(), absmax.data_ptr<float>(), L,
                                out.data_ptr<float>(), current_stream(d)),
           "dequantize (float8_e4m3fn)");
}

void adamw_fp8_step(const at::Tensor& p, const at::Tensor& g, const at::Tensor& q1,
                    const at::Tensor& a1, const at::Tensor& q2, const at::Tensor& a2,
                    const BlockLayout& L, const AdamWHyper& h) {
  check_step(p, g, q1, a1, q2, a2, L, "adamw8bit (float8_e4m3fn)");
  const at::Device d = p.device();
  if (L.numel == 0) return;
  c10::DeviceGuard guard(d);
  launched(cuda::adamw_fp8_step(p.data_ptr<float>(), g.data_ptr<float>(), q1.data_ptr<uint8_t>(),
                                a1.data_ptr<float>(), q2.data_ptr<uint8_t>(), a2.data_ptr<float>(),
                                L, h, current_stream(d)),
           "adamw8bit_step (float8_e4m3fn)");
}

void adamw_fp8_begin(const at::Tensor& p, const at::Tensor& g, const at::Tensor& q1,
                     const at::Tensor& a1, const at::Tensor& q2, const at::Tensor& a2,
                     const BlockLayout& L, const AdamWHyper& h, const at::Tensor& scratch,
                     const at::Tensor& amax1, const at::Tensor& amax2) {
  check_step(p, g, q1, a1, q2, a2, L, "adamw8bit_begin (float8_e4m3fn)");
  const at::Device d = p.device();
  check_begin(scratch, amax1, amax2, L, d);
  if (L.numel == 0) return;
  c10::DeviceGuard guard(d);
  launched(cuda::adamw_fp8_begin(p.data_ptr<float>(), g.data_ptr<float>(), q1.data_ptr<uint8_t>(),
                                 a1.data_ptr<float>(), q2.data_ptr<uint8_t>(), a2.data_ptr<float>(),
                                 L, h, scratch.data_ptr<float>(), amax1.data_ptr<float>(),
                                 amax2.data_ptr<float>(), current_stream(d)),
           "adamw8bit_begin (float8_e4m3fn)");
}

void adamw_fp8_end(const at::Tensor& scratch, const BlockLayout& L, const at::Tensor& agreed1,
                   const at::Tensor& agreed2, const at::Tensor& q1, const at::Tensor& a1,
                   const at::Tensor& q2, const at::Tensor& a2) {
  const at::Device d = check_end(scratch, agreed1, agreed2, q1, a1, q2, a2, L);
  if (L.numel == 0) return;
  c10::DeviceGuard guard(d);
  launched(cuda::adamw_fp8_end(scratch.data_ptr<float>(), L, agreed1.data_ptr<float>(),
                               agreed2.data_ptr<float>(), q1.data_ptr<uint8_t>(),
                               a1.data_ptr<float>(), q2.data_ptr<uint8_t>(), a2.data_ptr<float>(),
                               current_stream(d)),
           "adamw8bit_end (float8_e4m3fn)");
}

#else  // no nvcc at build time

namespace {
[[noreturn]] void none(const char* what) {
  throw std::invalid_argument(std::string(what) +
                              ": this build of rfsdp has no CUDA kernels (nvcc was not found when "
                              "it was built); rebuild with the CUDA toolkit installed "
                              "(RFSDP_CUDA=ON) to run 8-bit optimizer states on a GPU");
}
}  // namespace

bool built() { return false; }
void quantize(const at::Tensor&, const BlockLayout&, const at::Tensor&, const cpu::CodeLut&,
              const at::Tensor&, const at::Tensor&) {
  none("quantize");
}
void dequantize(const at::Tensor&, const at::Tensor&, const BlockLayout&, const at::Tensor&,
                const at::Tensor&) {
  none("dequantize");
}
void adamw8bit_step(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const at::Tensor&, const at::Tensor&, const BlockLayout&, const at::Tensor&,
                    const cpu::CodeLut&, const at::Tensor&, const cpu::CodeLut&,
                    const AdamWHyper&) {
  none("adamw8bit_step");
}
void adamw8bit_begin(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, const at::Tensor&, const BlockLayout&, const at::Tensor&,
                     const at::Tensor&, const AdamWHyper&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&) {
  none("adamw8bit_begin");
}
void adamw8bit_end(const at::Tensor&, const BlockLayout&, const at::Tensor&, const cpu::CodeLut&,
                   const at::Tensor&, const cpu::CodeLut&, const at::Tensor&, const at::Tensor&,
                   const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  none("adamw8bit_end");
}

void quantize_fp8(const at::Tensor&, const BlockLayout&, bool, const at::Tensor&,
                  const at::Tensor&) {
  none("quantize");
}
void dequantize_fp8(const at::Tensor&, const at::Tensor&, const BlockLayout&, const at::Tensor&) {
  none("dequantize");
}
void adamw_fp8_step(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const at::Tensor&, const at::Tensor&, const BlockLayout&, const AdamWHyper&) {
  none("adamw8bit_step");
}
void adamw_fp8_begin(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, const at::Tensor&, const BlockLayout&, const AdamWHyper&,
                     const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  none("adamw8bit_begin");
}
void adamw_fp8_end(const at::Tensor&, const BlockLayout&, const at::Tensor&, const at::Tensor&,
                   const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  none("adamw8bit_end");
}

#endif

}  // namespace rfsdp::quant::cuda_ops
