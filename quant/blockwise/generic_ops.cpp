#include "quant/blockwise/generic_ops.h"

namespace rfsdp::quant::generic {

// Every expression below is one IEEE operation per ATen call on fp32 values, in
// the order the CPU kernels compute it (adamw_update.h, cpu_kernels_portable.cpp):
// a tensor-by-scalar product rounds as the kernels' float product, a sum with
// alpha 1 or -1 as their sum or difference. Nothing here may reassociate.

DeviceCode device_code(const cpu::CodeLut& lut, at::Device device) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  DeviceCode c;
  c.values = at::from_blob(const_cast<float*>(lut.code()), {256}, f32).to(device, /*non_blocking=*/false,
                                                                          /*copy=*/true);
  // mid[255] is +inf: bucketize over the 255 finite ones gives 0..255.
  c.mids = at::from_blob(const_cast<float*>(lut.mid()), {255}, f32).to(device, false, true);
  return c;
}

at::Tensor block_ids(const BlockLayout& L, at::Device device) {
  const auto i64 = at::TensorOptions().dtype(at::kLong).device(device);
  if (!L.shape.is_tile()) return at::arange(L.numel, i64).div_(L.shape.block, "floor");
  const at::Tensor tile_row = at::arange(L.rows, i64).div_(L.shape.tile_rows, "floor").mul_(L.tiles_per_row);
  const at::Tensor tile_col = at::arange(L.row_len, i64).div_(L.shape.tile_cols, "floor");
  return (tile_row.unsqueeze(1) + tile_col.unsqueeze(0)).reshape(-1);
}

namespace {

// Max |x| per block (from 0, as the kernels start).
at::Tensor block_amax(const at::Tensor& x, const at::Tensor& ids, int64_t blocks) {
  return at::zeros({blocks}, x.options()).scatter_reduce_(0, ids, x.abs(), "amax", true);
}

// The codes of x under absmax per block: x * (1 / absmax), or 0 where the absmax is 0.
void encode(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& absmax,
            const DeviceCode& code, const at::Tensor& q) {
  const at::Tensor scale =
      at::where(absmax > 0, at::ones_like(absmax).div_(absmax), at::zeros_like(absmax));
  const at::Tensor v = x * scale.index_select(0, ids);
  q.copy_(at::bucketize(v, code.mids, /*out_int32=*/true, /*right=*/false));
}

at::Tensor decode(const at::Tensor& q, const at::Tensor& absmax, const at::Tensor& ids,
                  const DeviceCode& code) {
  return code.values.index_select(0, q.to(at::kLong)) * absmax.index_select(0, ids);
}

// torch.lerp's float arithmetic (cpu_kernels_portable.cpp's torch_lerp), the branch
// chosen once for a scalar weight w.
at::Tensor torch_lerp(const at::Tensor& a, const at::Tensor& b, float w) {
  at::Tensor d = b - a;
  if (std::fabs(w) < 0.5f) return d.mul_(w).add_(a);
  return at::sub(b, d.mul_(1.0f - w));
}

at::Tensor sqrt_rounded(const at::Tensor& v) { return v.to(at::kDouble).sqrt_().to(at::kFloat); }

// adamw_update on whole tensors: m, v updated in place, the parameter in place.
void adamw_update(const at::Tensor& p, const at::Tensor& m, const at::Tensor& v,
                  const at::Tensor& g, const AdamWCoeffs& c) {
  m.mul_(c.b1).add_(g * c.one_minus_b1);
  v.mul_(c.b2).add_((g * c.one_minus_b2).mul_(g));
  // The fp32 square root correctly rounded, as the kernels' sqrtf: ATen's fp32 sqrt on
  // the CPU is not (it is 1 ulp low on ~0.6 % of values: Sleef's u05), its fp64 one is
  // within an ulp of fp64, and the float nearest that is the float nearest the true
  // root (a root of a float lies at least 2^-51 relative from any float midpoint).
  const at::Tensor denom = sqrt_rounded(v).mul_(c.inv_sqrt_bc2).add_(c.eps);
  p.mul_(c.decay).sub_(at::div(m, denom).mul_(c.step_size));
}

}  // namespace

at::Tensor quantize(const at::Tensor& x, const BlockLayout& L, const DeviceCode& code,
                    const at::Tensor& q, const at::Tensor& absmax) {
  const at::Tensor ids = block_ids(L, x.device());
  const at::Tensor flat = x.reshape(-1);
  absmax.copy_(block_amax(flat, ids, L.num_blocks));
  encode(flat, ids, absmax, code, q.view(-1));
  return at::isfinite(flat).all();
}

void dequantize(const at::Tensor& q, const at::Tensor& absmax, const BlockLayout& L,
                const DeviceCode& code, const at::Tensor& out) {
  out.view(-1).copy_(decode(q.view(-1), absmax, block_ids(L, q.device()), code));
}

SteppedMoments adamw8bit_begin(const at::Tensor& param, const at::Tensor& grad,
                               const at::Tensor& q1, const at::Tensor& absmax1,
                               const at::Tensor& q2, const at::Tensor& absmax2,
                               const BlockLayout& L, const DeviceCode& code1,
                               const DeviceCode& code2, const AdamWHyper& h) {
  const at::Tensor ids = block_ids(L, param.device());
  SteppedMoments s;
  s.m = decode(q1.view(-1), absmax1, ids, code1);
  s.v = decode(q2.view(-1), absmax2, ids, code2);
  adamw_update(param.view(-1), s.m, s.v, grad.reshape(-1), adamw_coeffs(h));
  s.amax1 = block_amax(s.m, ids, L.num_blocks);
  s.amax2 = block_amax(s.v, ids, L.num_blocks);
  return s;
}

void adamw8bit_end(const SteppedMoments& s, const at::Tensor& agreed1, const at::Tensor& agreed2,
                   const BlockLayout& L, const DeviceCode& code1, const DeviceCode& code2,
                   const at::Tensor& q1, const at::Tensor& absmax1, const at::Tensor& q2,
                   const at::Tensor& absmax2) {
  const at::Tensor ids = block_ids(L, s.m.device());
  encode(s.m, ids, agreed1, code1, q1.view(-1));
  encode(s.v, ids, agreed2, code2, q2.view(-1));
  absmax1.copy_(agreed1);
  absmax2.copy_(agreed2);
}

void adamw8bit_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& q1,
                    const at::Tensor& absmax1, const at::Tensor& q2, const at::Tensor& absmax2,
                    const BlockLayout& L, const DeviceCode& code1, const DeviceCode& code2,
                    const AdamWHyper& h) {
  const SteppedMoments s = adamw8bit_begin(param, grad, q1, absmax1, q2, absmax2, L, code1, code2, h);
  adamw8bit_end(s, s.amax1, s.amax2, L, code1, code2, q1, absmax1, q2, absmax2);
}

at::Tensor momentum8bit_step(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& absmax,
                             const BlockLayout& L, const DeviceCode& code, float beta,
                             bool nesterov, const at::Tensor& q_out, const at::Tensor& absmax_out,
                             const at::Tensor& u) {
  const at::Tensor ids = block_ids(L, grad.device());
  const at::Tensor g = grad.reshape(-1);
  const at::Tensor m = torch_lerp(decode(q.view(-1), absmax, ids, code), g, 1.0f - beta);
  u.view(-1).copy_(nesterov ? torch_lerp(g, m, beta) : m);
  absmax_out.copy_(block_amax(m, ids, L.num_blocks));
  encode(m, ids, absmax_out, code, q_out.view(-1));
  return at::isfinite(m).all();
}

}  // namespace rfsdp::quant::generic
