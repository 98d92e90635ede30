// The device-generic path of the block-wise 8-bit states: every operation of
// the CPU kernels (cpu/kernels.h) written in ATen operations on the tensors'
// device, with no host pointers and no per-element host loops, so a GPU with no
// kernel for it runs it as it is. Bit for bit the CPU kernels (the portable ones,
// and every kernel set held to them): the same IEEE operations in the same order
// (no fused multiply-add), the nearest code by the same midpoints with ties to the
// lower code (bucketize), the scale 1 / absmax in fp32. Tests compare them.
//
// Tensors: fp32 (uint8 codes) on one device, contiguous, laid out as `L` (the
// flat elements of a rows x row_len region); absmax: L.num_blocks fp32.
#pragma once

#include <ATen/ATen.h>

#include "quant/formats/block_layout.h"
#include "quant/formats/code_lut.h"
#include "quant/kernels/adamw_update.h"

namespace rfsdp::quant::generic {

// A code's 256 values and its 255 finite midpoints (the CodeLut's, so the
// rounding is the kernels': keep_nonzero included) on a device; or, fp8 set,
// the float8_e4m3fn format (formats/fp8_e4m3.h: torch's own cast and its
// inverse, no tensors).
struct DeviceCode {
  at::Tensor values, mids;
  bool fp8 = false, keep_nonzero = false;
};
DeviceCode device_code(const cpu::CodeLut& lut, at::Device device);

// Codes and absmax of x. Returns a bool scalar on x's device: x is finite
// (otherwise the outputs are meaningless), left on the device so a caller that
// needs it decides when to wait.
at::Tensor quantize(const at::Tensor& x, const BlockLayout& L, const DeviceCode& code,
                    const at::Tensor& q, const at::Tensor& absmax);

void dequantize(const at::Tensor& q, const at::Tensor& absmax, const BlockLayout& L,
                const DeviceCode& code, const at::Tensor& out);

// adamw8bit_step: the parameter and the codes updated in place.
void adamw8bit_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& q1,
                    const at::Tensor& absmax1, const at::Tensor& q2, const at::Tensor& absmax2,
                    const BlockLayout& L, const DeviceCode& code1, const DeviceCode& code2,
                    const AdamWHyper& h);

// The step of blocks that ranks share, in two halves around the agreement of each
// block's absmax (cpu/kernels.h). begin updates the parameter and returns the new
// moments and their max |.| per block; end stores the moments' codes under the
// agreed absmax (and the agreed absmax).
struct SteppedMoments {
  at::Tensor m, v, amax1, amax2;
};
SteppedMoments adamw8bit_begin(const at::Tensor& param, const at::Tensor& grad,
                               const at::Tensor& q1, const at::Tensor& absmax1,
                               const at::Tensor& q2, const at::Tensor& absmax2,
                               const BlockLayout& L, const DeviceCode& code1,
                               const DeviceCode& code2, const AdamWHyper& h);
void adamw8bit_end(const SteppedMoments& s, const at::Tensor& agreed1, const at::Tensor& agreed2,
                   const BlockLayout& L, const DeviceCode& code1, const DeviceCode& code2,
                   const at::Tensor& q1, const at::Tensor& absmax1, const at::Tensor& q2,
                   const at::Tensor& absmax2);

// Muon's 8-bit momentum step (cpu/kernels.h momentum8bit_step): the update into
// u, the new momentum's codes into q_out, absmax_out. Returns "m is finite" as
// quantize does.
at::Tensor momentum8bit_step(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& absmax,
                             const BlockLayout& L, const DeviceCode& code, float beta,
                             bool nesterov, const at::Tensor& q_out, const at::Tensor& absmax_out,
                             const at::Tensor& u);

}  // namespace rfsdp::quant::generic
