#include "quant/kernels/aten/generic_ops.h"

#include <cfloat>
#include <cmath>
#include <vector>

#include "quant/formats/fp8_e4m3.h"

namespace rfsdp::quant::generic {

// Every expression below is one IEEE operation per ATen call on fp32 values, in
// the order the CPU kernels compute it (adamw_update.h, cpu/portable.cpp):
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

namespace {

// The block of every element (int64, L.numel): 1-D blocks or row-major tiles.
at::Tensor block_ids(const BlockLayout& L, at::Device device) {
  const auto i64 = at::TensorOptions().dtype(at::kLong).device(device);
  if (!L.shape.is_tile()) return at::arange(L.numel, i64).div_(L.shape.block, "floor");
  const at::Tensor tile_row = at::arange(L.rows, i64).div_(L.shape.tile_rows, "floor").mul_(L.tiles_per_row);
  const at::Tensor tile_col = at::arange(L.row_len, i64).div_(L.shape.tile_cols, "floor");
  return (tile_row.unsqueeze(1) + tile_col.unsqueeze(0)).reshape(-1);
}

// How a layout's elements group into blocks for ATen: 1-D blocks as rows of a
// [blocks, B] view (a partial last block apart), tiles that divide the region as
// a [R/TR, TR, C/TC, TC] view, other tiles by each element's block id. Reductions
// and broadcasts over views cost what the data does; the ids (8 B an element, a
// scatter and a gather) only serve partial tiles.
class Blocked {
 public:
  Blocked(const BlockLayout& L, at::Device device) : L_(L) {
    if (L.shape.is_tile()) {
      tiled_ = L.rows % L.shape.tile_rows == 0 && L.row_len % L.shape.tile_cols == 0;
      if (!tiled_) ids_ = block_ids(L, device);
    } else {
      full_ = L.numel / L.shape.block;
    }
  }
  // Max |x| per block (from 0, as the kernels start), [L.num_blocks].
  at::Tensor amax(const at::Tensor& x) const {
    if (ids_.defined()) {
      return at::zeros({L_.num_blocks}, x.options()).scatter_reduce_(0, ids_, x.abs(), "amax", true);
    }
    if (tiled_) return tiles(x).abs().amax({1, 3}).reshape(-1);
    std::vector<at::Tensor> parts;
    if (full_ > 0) parts.push_back(body(x).abs().amax(1));
    if (tail(x).numel() > 0) parts.push_back(tail(x).abs().amax(0, /*keepdim=*/true));
    if (parts.empty()) return at::zeros({0}, x.options());  // an empty region
    return parts.size() == 1 ? parts[0] : at::cat(parts);
  }
  // x times its block's entry of s (s: one per block), flat.
  at::Tensor times(const at::Tensor& x, const at::Tensor& s) const {
    if (ids_.defined()) return x * s.index_select(0, ids_);
    if (tiled_) {
      const int64_t tr = L_.rows / L_.shape.tile_rows, tc = L_.row_len / L_.shape.tile_cols;
      return (tiles(x) * s.view({tr, 1, tc, 1})).view(-1);
    }
    std::vector<at::Tensor> parts;
    if (full_ > 0) parts.push_back((body(x) * s.narrow(0, 0, full_).unsqueeze(1)).view(-1));
    if (tail(x).numel() > 0) parts.push_back(tail(x) * s.narrow(0, full_, 1));
    if (parts.empty()) return x.clone();  // an empty region
    return parts.size() == 1 ? parts[0] : at::cat(parts);
  }

 private:
  at::Tensor body(const at::Tensor& x) const {
    return x.narrow(0, 0, full_ * L_.shape.block).view({full_, L_.shape.block});
  }
  at::Tensor tail(const at::Tensor& x) const {
    return x.narrow(0, full_ * L_.shape.block, L_.numel - full_ * L_.shape.block);
  }
  at::Tensor tiles(const at::Tensor& x) const {
    return x.view({L_.rows / L_.shape.tile_rows, L_.shape.tile_rows, L_.row_len / L_.shape.tile_cols,
                   L_.shape.tile_cols});
  }
  const BlockLayout& L_;
  bool tiled_ = false;
  int64_t full_ = 0;
  at::Tensor ids_;
};

// The float8_e4m3fn codes of x under absmax per block (fp8_e4m3.h): torch's cast
// of x * (448 / absmax), that factor held below +inf and 0 where the absmax is 0;
// keep_nonzero: code 1 where a value above 0 casts to 0.
void encode_fp8(const at::Tensor& x, const Blocked& blocks, const at::Tensor& absmax,
                const DeviceCode& code, const at::Tensor& q) {
  const at::Tensor r = at::where(absmax > 0,
                                 at::full_like(absmax, fp8::kMax).div_(absmax).clamp_max_(FLT_MAX),
                                 at::zeros_like(absmax));
  const at::Tensor y = blocks.times(x, r);
  at::Tensor c = y.to(at::kFloat8_e4m3fn).view(at::kByte);
  if (code.keep_nonzero) c = at::where(c.eq(0).logical_and_(y > 0), at::ones_like(c), c);
  q.copy_(c);
}

// The codes of x under absmax per block: x * (1 / absmax), or 0 where the absmax is 0.
void encode(const at::Tensor& x, const Blocked& blocks, const at::Tensor& absmax,
            const DeviceCode& code, const at::Tensor& q) {
  if (code.fp8) return encode_fp8(x, blocks, absmax, code, q);
  const at::Tensor scale =
      at::where(absmax > 0, at::ones_like(absmax).div_(absmax), at::zeros_like(absmax));
  q.copy_(at::bucketize(blocks.times(x, scale), code.mids, /*out_int32=*/true, /*right=*/false));
}

at::Tensor decode(const at::Tensor& q, const at::Tensor& absmax, const Blocked& blocks,
                  const DeviceCode& code) {
  if (code.fp8) {  // torch's float8_e4m3fn values times absmax / 448
    return blocks.times(q.view(at::kFloat8_e4m3fn).to(at::kFloat), absmax / fp8::kMax);
  }
  return blocks.times(code.values.index_select(0, q.to(at::kLong)), absmax);
}

// torch.lerp's float arithmetic (cpu/portable.cpp's torch_lerp), the branch
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
  const Blocked blocks(L, x.device());
  const at::Tensor flat = x.reshape(-1);
  absmax.copy_(blocks.amax(flat));
  encode(flat, blocks, absmax, code, q.view(-1));
  return at::isfinite(flat).all();
}

void dequantize(const at::Tensor& q, const at::Tensor& absmax, const BlockLayout& L,
                const DeviceCode& code, const at::Tensor& out) {
  out.view(-1).copy_(decode(q.view(-1), absmax, Blocked(L, q.device()), code));
}

SteppedMoments adamw8bit_begin(const at::Tensor& param, const at::Tensor& grad,
                               const at::Tensor& q1, const at::Tensor& absmax1,
                               const at::Tensor& q2, const at::Tensor& absmax2,
                               const BlockLayout& L, const DeviceCode& code1,
                               const DeviceCode& code2, const AdamWHyper& h) {
  const Blocked blocks(L, param.device());
  SteppedMoments s;
  s.m = decode(q1.view(-1), absmax1, blocks, code1);
  s.v = decode(q2.view(-1), absmax2, blocks, code2);
  adamw_update(param.view(-1), s.m, s.v, grad.reshape(-1), adamw_coeffs(h));
  s.amax1 = blocks.amax(s.m);
  s.amax2 = blocks.amax(s.v);
  return s;
}

void adamw8bit_end(const SteppedMoments& s, const at::Tensor& agreed1, const at::Tensor& agreed2,
                   const BlockLayout& L, const DeviceCode& code1, const DeviceCode& code2,
                   const at::Tensor& q1, const at::Tensor& absmax1, const at::Tensor& q2,
                   const at::Tensor& absmax2) {
  const Blocked blocks(L, s.m.device());
  encode(s.m, blocks, agreed1, code1, q1.view(-1));
  encode(s.v, blocks, agreed2, code2, q2.view(-1));
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
  const Blocked blocks(L, grad.device());
  const at::Tensor g = grad.reshape(-1);
  const at::Tensor m = torch_lerp(decode(q.view(-1), absmax, blocks, code), g, 1.0f - beta);
  u.view(-1).copy_(nesterov ? torch_lerp(g, m, beta) : m);
  absmax_out.copy_(blocks.amax(m));
  encode(m, blocks, absmax_out, code, q_out.view(-1));
  return at::isfinite(m).all();
}

}  // namespace rfsdp::quant::generic
