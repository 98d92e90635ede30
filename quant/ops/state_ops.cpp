#include "quant/ops/state_ops.h"

#include <stdexcept>
#include <string>
#include <tuple>

#include "quant/formats/code_maps.h"
#include "quant/kernels/cpu/kernels.h"
#include "quant/kernels/cuda/ops.h"
#include "quant/ops/device_path.h"

namespace rfsdp::quant {

Codec::Codec(const at::Tensor& code, bool keep_nonzero)
    : lut_(code_lut(code, keep_nonzero)), keep_nonzero_(keep_nonzero) {}

Codec Codec::float8_e4m3(bool keep_nonzero) {
  Codec c;
  c.fp8_ = true;
  c.keep_nonzero_ = keep_nonzero;
  return c;
}

Codec Codec::of(StateFormat f, bool is_signed) {
  if (f == StateFormat::kFloat8E4M3) return float8_e4m3(/*keep_nonzero=*/!is_signed);
  return Codec(dynamic_map(is_signed), /*keep_nonzero=*/!is_signed);
}

const cpu::CodeLut& Codec::lut() const {
  if (!lut_) throw std::logic_error("Codec::lut: this code has no table (float8_e4m3fn or none)");
  return *lut_;
}

uint8_t Codec::zero_code() const { return fp8_ ? uint8_t{0} : lut().nearest(0.0f); }

const generic::DeviceCode& Codec::on(at::Device device) const {
  std::lock_guard<std::mutex> lock(on_->mu);
  if (fp8_) {
    if (on_->codes.empty()) {
      generic::DeviceCode c;
      c.fp8 = true;
      c.keep_nonzero = keep_nonzero_;
      on_->codes.emplace_back(device, c);
    }
    return on_->codes.front().second;  // (no tensors: one for every device)
  }
  for (const auto& [d, c] : on_->codes) {
    if (d == device) return c;
  }
  on_->codes.emplace_back(device, generic::device_code(*lut_, device));
  return on_->codes.back().second;
}

namespace {

enum class Path { kCpuKernels, kCudaKernels, kGeneric };

// cuda_kernel: the CUDA kernels have this operation.
Path path_of(const at::Tensor& t, bool cuda_kernel) {
  if (device_generic_path()) return Path::kGeneric;
  if (t.device().is_cpu()) return Path::kCpuKernels;
  if (t.device().is_cuda() && cuda_kernel && cuda_ops::built()) return Path::kCudaKernels;
  return Path::kGeneric;
}

// Every tensor contiguous, of its dtype and element count, on `like`'s device.
void check(const char* op, const at::Tensor& like,
           std::initializer_list<std::tuple<const at::Tensor*, at::ScalarType, int64_t, const char*>> ts) {
  for (const auto& [t, dt, n, what] : ts) {
    if (!t->defined() || t->scalar_type() != dt || !t->is_contiguous() || t->numel() != n ||
        t->device() != like.device()) {
      throw std::invalid_argument(
          std::string(op) + ": " + what + " must be a contiguous " + c10::toString(dt) +
          " tensor of " + std::to_string(n) + " elements on " + like.device().str() + ", got " +
          (t->defined() ? std::to_string(t->numel()) + " " + c10::toString(t->scalar_type()) +
                              (t->is_contiguous() ? "" : " (not contiguous)") + " on " +
                              t->device().str()
                        : std::string("none")));
    }
  }
}

}  // namespace

bool quantize(const at::Tensor& x, const BlockLayout& L, const Codec& code, const at::Tensor& q,
              const at::Tensor& absmax, bool check_finite) {
  check("quantize", x, {{&x, at::kFloat, L.numel, "the input"}, {&q, at::kByte, L.numel, "the codes"},
                        {&absmax, at::kFloat, L.num_blocks, "absmax"}});
  switch (path_of(x, true)) {
    case Path::kCpuKernels:
      if (code.fp8()) {
        return cpu::quantize_fp8(x.data_ptr<float>(), L, code.keep_nonzero(),
                                 q.data_ptr<uint8_t>(), absmax.data_ptr<float>());
      }
      return cpu::quantize(x.data_ptr<float>(), L, code.lut(), q.data_ptr<uint8_t>(),
                           absmax.data_ptr<float>());
    case Path::kCudaKernels:
      if (check_finite && !at::isfinite(x).all().item<bool>()) return false;
      if (code.fp8()) {
        cuda_ops::quantize_fp8(x.view(-1), L, code.keep_nonzero(), q.view(-1), absmax);
        return true;
      }
      cuda_ops::quantize(x.view(-1), L, code.on(x.device()).values, code.lut(), q.view(-1), absmax);
      return true;
    case Path::kGeneric:
      break;
  }
  const at::Tensor finite = generic::quantize(x, L, code.on(x.device()), q, absmax);
  return !check_finite || finite.item<bool>();
}

void dequantize(const at::Tensor& q, const at::Tensor& absmax, const BlockLayout& L,
                const Codec& code, const at::Tensor& out) {
  check("dequantize", q, {{&q, at::kByte, L.numel, "the codes"}, {&absmax, at::kFloat, L.num_blocks, "absmax"},
                          {&out, at::kFloat, L.numel, "the output"}});
  switch (path_of(q, true)) {
    case Path::kCpuKernels:
      if (code.fp8()) {
        return cpu::dequantize_fp8(q.data_ptr<uint8_t>(), absmax.data_ptr<float>(), L,
                                   out.data_ptr<float>());
      }
      return cpu::dequantize(q.data_ptr<uint8_t>(), absmax.data_ptr<float>(), L, code.lut(),
                             out.data_ptr<float>());
    case Path::kCudaKernels:
      if (code.fp8()) return cuda_ops::dequantize_fp8(q.view(-1), absmax, L, out.view(-1));
      return cuda_ops::dequantize(q.view(-1), absmax, L, code.on(q.device()).values, out.view(-1));
    case Path::kGeneric:
      return generic::dequantize(q, absmax, L, code.on(q.device()), out);
  }
}

namespace {
void check_step(const char* op, const at::Tensor& param, const at::Tensor& grad,
                const at::Tensor& q1, const at::Tensor& absmax1, const at::Tensor& q2,
                const at::Tensor& absmax2, const BlockLayout& L) {
  check(op, param, {{&param, at::kFloat, L.numel, "the parameter"}, {&grad, at::kFloat, L.numel, "the gradient"},
                    {&q1, at::kByte, L.numel, "the first moment's codes"},
                    {&absmax1, at::kFloat, L.num_blocks, "the first moment's absmax"},
                    {&q2, at::kByte, L.numel, "the second moment's codes"},
                    {&absmax2, at::kFloat, L.num_blocks, "the second moment's absmax"}});
}
void check_formats(const char* op, const Codec& code1, const Codec& code2) {
  if (code1.fp8() != code2.fp8()) {
    throw std::invalid_argument(std::string(op) + ": both moments take one format (the dynamic "
                                "map or float8_e4m3fn), got one of each");
  }
}
}  // namespace

void adamw8bit_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& q1,
                    const at::Tensor& absmax1, const at::Tensor& q2, const at::Tensor& absmax2,
                    const BlockLayout& L, const Codec& code1, const Codec& code2,
                    const AdamWHyper& h) {
  check_step("adamw8bit_step", param, grad, q1, absmax1, q2, absmax2, L);
  check_formats("adamw8bit_step", code1, code2);
  switch (path_of(param, true)) {
    case Path::kCpuKernels:
      if (code1.fp8()) {
        return cpu::adamw_fp8_step(param.data_ptr<float>(), grad.data_ptr<float>(),
                                   q1.data_ptr<uint8_t>(), absmax1.data_ptr<float>(),
                                   q2.data_ptr<uint8_t>(), absmax2.data_ptr<float>(), L, h);
      }
      return cpu::adamw8bit_step(param.data_ptr<float>(), grad.data_ptr<float>(),
                                 q1.data_ptr<uint8_t>(), absmax1.data_ptr<float>(),
                                 q2.data_ptr<uint8_t>(), absmax2.data_ptr<float>(), L, code1.lut(),
                                 code2.lut(), h);
    case Path::kCudaKernels:
      if (code1.fp8()) {
        return cuda_ops::adamw_fp8_step(param.view(-1), grad.view(-1), q1.view(-1), absmax1,
                                        q2.view(-1), absmax2, L, h);
      }
      return cuda_ops::adamw8bit_step(param.view(-1), grad.view(-1), q1.view(-1), absmax1,
                                      q2.view(-1), absmax2, L, code1.on(param.device()).values,
                                      code1.lut(), code2.on(param.device()).values, code2.lut(), h);
    case Path::kGeneric:
      return generic::adamw8bit_step(param, grad, q1, absmax1, q2, absmax2, L,
                                     code1.on(param.device()), code2.on(param.device()), h);
  }
}

SharedStep adamw8bit_begin(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& q1,
                           const at::Tensor& absmax1, const at::Tensor& q2,
                           const at::Tensor& absmax2, const BlockLayout& L, const Codec& code1,
                           const Codec& code2, const AdamWHyper& h) {
  check_step("adamw8bit_begin", param, grad, q1, absmax1, q2, absmax2, L);
  check_formats("adamw8bit_begin", code1, code2);
  SharedStep s;
  const Path path = path_of(param, true);
  if (path == Path::kGeneric) {
    s.moments = generic::adamw8bit_begin(param, grad, q1, absmax1, q2, absmax2, L,
                                         code1.on(param.device()), code2.on(param.device()), h);
    return s;
  }
  s.scratch = at::empty({2 * L.num_blocks * L.max_block_elems()}, param.options());
  s.moments.amax1 = at::empty({L.num_blocks}, param.options());
  s.moments.amax2 = at::empty({L.num_blocks}, param.options());
  if (path == Path::kCudaKernels && code1.fp8()) {
    cuda_ops::adamw_fp8_begin(param.view(-1), grad.view(-1), q1.view(-1), absmax1, q2.view(-1),
                              absmax2, L, h, s.scratch, s.moments.amax1, s.moments.amax2);
    return s;
  }
  if (path == Path::kCudaKernels) {
    cuda_ops::adamw8bit_begin(param.view(-1), grad.view(-1), q1.view(-1), absmax1, q2.view(-1),
                              absmax2, L, code1.on(param.device()).values,
                              code2.on(param.device()).values, h, s.scratch, s.moments.amax1,
                              s.moments.amax2);
    return s;
  }
  if (code1.fp8()) {
    cpu::adamw_fp8_begin(param.data_ptr<float>(), grad.data_ptr<float>(), q1.data_ptr<uint8_t>(),
                         absmax1.data_ptr<float>(), q2.data_ptr<uint8_t>(),
                         absmax2.data_ptr<float>(), L, h, s.scratch.data_ptr<float>(),
                         s.moments.amax1.data_ptr<float>(), s.moments.amax2.data_ptr<float>());
    return s;
  }
  cpu::adamw8bit_begin(param.data_ptr<float>(), grad.data_ptr<float>(), q1.data_ptr<uint8_t>(),
                       absmax1.data_ptr<float>(), q2.data_ptr<uint8_t>(), absmax2.data_ptr<float>(),
                       L, code1.lut(), code2.lut(), h, s.scratch.data_ptr<float>(),
                       s.moments.amax1.data_ptr<float>(), s.moments.amax2.data_ptr<float>());
  return s;
}

void adamw8bit_end(const SharedStep& s, const at::Tensor& agreed1, const at::Tensor& agreed2,
                   const BlockLayout& L, const Codec& code1, const Codec& code2,
                   const at::Tensor& q1, const at::Tensor& absmax1, const at::Tensor& q2,
                   const at::Tensor& absmax2) {
  check("adamw8bit_end", q1, {{&agreed1, at::kFloat, L.num_blocks, "the agreed first absmax"},
                              {&agreed2, at::kFloat, L.num_blocks, "the agreed second absmax"},
                              {&q1, at::kByte, L.numel, "the first moment's codes"},
                              {&absmax1, at::kFloat, L.num_blocks, "the first moment's absmax"},
                              {&q2, at::kByte, L.numel, "the second moment's codes"},
                              {&absmax2, at::kFloat, L.num_blocks, "the second moment's absmax"}});
  check_formats("adamw8bit_end", code1, code2);
  if (!s.scratch.defined()) {  // begun on the generic path
    return generic::adamw8bit_end(s.moments, agreed1, agreed2, L, code1.on(q1.device()),
                                  code2.on(q1.device()), q1, absmax1, q2, absmax2);
  }
  if (s.scratch.is_cuda() && code1.fp8()) {
    return cuda_ops::adamw_fp8_end(s.scratch, L, agreed1, agreed2, q1.view(-1), absmax1,
                                   q2.view(-1), absmax2);
  }
  if (s.scratch.is_cuda()) {
    return cuda_ops::adamw8bit_end(s.scratch, L, code1.on(q1.device()).values, code1.lut(),
                                   code2.on(q1.device()).values, code2.lut(), agreed1, agreed2,
                                   q1.view(-1), absmax1, q2.view(-1), absmax2);
  }
  if (code1.fp8()) {
    return cpu::adamw_fp8_end(s.scratch.data_ptr<float>(), L, agreed1.data_ptr<float>(),
                              agreed2.data_ptr<float>(), q1.data_ptr<uint8_t>(),
                              absmax1.data_ptr<float>(), q2.data_ptr<uint8_t>(),
                              absmax2.data_ptr<float>());
  }
  cpu::adamw8bit_end(s.scratch.data_ptr<float>(), L, code1.lut(), code2.lut(),
                     agreed1.data_ptr<float>(), agreed2.data_ptr<float>(), q1.data_ptr<uint8_t>(),
                     absmax1.data_ptr<float>(), q2.data_ptr<uint8_t>(), absmax2.data_ptr<float>());
}

void momentum8bit_step(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& absmax,
                       const BlockLayout& L, const Codec& code, float beta, bool nesterov,
                       const at::Tensor& q_out, const at::Tensor& absmax_out, const at::Tensor& u) {
  check("momentum8bit_step", grad, {{&grad, at::kFloat, L.numel, "the gradient"},
                                    {&q, at::kByte, L.numel, "the momentum's codes"},
                                    {&absmax, at::kFloat, L.num_blocks, "the momentum's absmax"},
                                    {&q_out, at::kByte, L.numel, "the new codes"},
                                    {&absmax_out, at::kFloat, L.num_blocks, "the new absmax"},
                                    {&u, at::kFloat, L.numel, "the update"}});
  if (path_of(grad, false) == Path::kGeneric) {
    generic::momentum8bit_step(grad, q, absmax, L, code.on(grad.device()), beta, nesterov, q_out,
                               absmax_out, u);
    return;
  }
  if (code.fp8()) {
    cpu::momentum_fp8_step(grad.data_ptr<float>(), q.data_ptr<uint8_t>(), absmax.data_ptr<float>(),
                           L, beta, nesterov, q_out.data_ptr<uint8_t>(),
                           absmax_out.data_ptr<float>(), u.data_ptr<float>());
    return;
  }
  cpu::momentum8bit_step(grad.data_ptr<float>(), q.data_ptr<uint8_t>(), absmax.data_ptr<float>(),
                         L, code.lut(), beta, nesterov, q_out.data_ptr<uint8_t>(),
                         absmax_out.data_ptr<float>(), u.data_ptr<float>());
}

}  // namespace rfsdp::quant
