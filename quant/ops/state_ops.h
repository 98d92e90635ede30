// Block-wise 8-bit optimizer states on ATen tensors, each operation run on the
// path its tensors' device has (device_path.h): the CPU kernels (cpu/kernels.h),
// the CUDA kernels where one exists and is built (cuda/ops.h), else the
// device-generic ATen path (generic_ops.h). All give the same bits (tests
// compare them), so which one ran never shows in the numbers. What the
// optimizers call; none of them touches a raw pointer of a state.
//
// Tensors: contiguous, on one device, the flat elements of the region `L`
// describes; values, gradients and parameters fp32, codes uint8, absmax fp32
// (L.num_blocks).
#pragma once

#include <ATen/ATen.h>

#include <deque>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "quant/formats/block_layout.h"
#include "quant/formats/code_lut.h"
#include "quant/formats/code_maps.h"
#include "quant/kernels/adamw_update.h"
#include "quant/kernels/aten/generic_ops.h"

namespace rfsdp::quant {

// One code for every path: a code map (the CPU table and, per device, its
// values and midpoints, made on first use there), or the float8_e4m3fn format
// (formats/fp8_e4m3.h: arithmetic, no table).
class Codec {
 public:
  Codec() = default;
  // code: 256 sorted fp32 values; keep_nonzero: CodeLut's rounding of v.
  Codec(const at::Tensor& code, bool keep_nonzero = false);
  // float8_e4m3fn codes; keep_nonzero: a value above 0 never takes code 0.
  static Codec float8_e4m3(bool keep_nonzero);
  // An optimizer state's code in format f: signed (Adam's m, momentum) or not
  // (Adam's v: keep_nonzero).
  static Codec of(StateFormat f, bool is_signed);
  bool defined() const { return lut_ != nullptr || fp8_; }
  bool fp8() const { return fp8_; }
  bool keep_nonzero() const { return keep_nonzero_; }
  const cpu::CodeLut& lut() const;  // a code map's (throws for float8)
  uint8_t zero_code() const;        // the code of 0 (a fresh state's)
  const generic::DeviceCode& on(at::Device device) const;

 private:
  std::shared_ptr<const cpu::CodeLut> lut_;
  bool fp8_ = false, keep_nonzero_ = false;
  struct OnDevices {
    std::mutex mu;
    std::deque<std::pair<at::Device, generic::DeviceCode>> codes;  // (stable references)
  };
  std::shared_ptr<OnDevices> on_ = std::make_shared<OnDevices>();
};

// Codes and absmax of x; false when x holds NaN or Inf (the outputs are then
// meaningless). On a GPU the answer waits for the device: a caller that checks
// its values elsewhere passes check_finite false (then it returns true).
bool quantize(const at::Tensor& x, const BlockLayout& L, const Codec& code, const at::Tensor& q,
              const at::Tensor& absmax, bool check_finite = true);
void dequantize(const at::Tensor& q, const at::Tensor& absmax, const BlockLayout& L,
                const Codec& code, const at::Tensor& out);

// One fused AdamW step with 8-bit moments (m: code1, v: code2), in place.
void adamw8bit_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& q1,
                    const at::Tensor& absmax1, const at::Tensor& q2, const at::Tensor& absmax2,
                    const BlockLayout& L, const Codec& code1, const Codec& code2,
                    const AdamWHyper& h);

// The same step for blocks that ranks share, in two halves around the agreement
// of each block's absmax (the max over the ranks): begin updates the parameter
// and returns the new moments (held in the form its path keeps them) with this
// rank's max |.| per block in amax1, amax2 (fp32, on the parameter's device);
// end stores their codes under the agreed absmax. With every block whole and
// agreed = amax the two are adamw8bit_step bit for bit.
struct SharedStep {
  generic::SteppedMoments moments;  // amax1, amax2 always; m, v on the generic path
  at::Tensor scratch;               // the CPU or CUDA kernels' moments
};
SharedStep adamw8bit_begin(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& q1,
                           const at::Tensor& absmax1, const at::Tensor& q2,
                           const at::Tensor& absmax2, const BlockLayout& L, const Codec& code1,
                           const Codec& code2, const AdamWHyper& h);
void adamw8bit_end(const SharedStep& s, const at::Tensor& agreed1, const at::Tensor& agreed2,
                   const BlockLayout& L, const Codec& code1, const Codec& code2,
                   const at::Tensor& q1, const at::Tensor& absmax1, const at::Tensor& q2,
                   const at::Tensor& absmax2);

// Muon's 8-bit momentum: the update into u (fp32), the new momentum's codes and
// absmax into q_out, absmax_out (they may be q, absmax).
void momentum8bit_step(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& absmax,
                       const BlockLayout& L, const Codec& code, float beta, bool nesterov,
                       const at::Tensor& q_out, const at::Tensor& absmax_out, const at::Tensor& u);

}  // namespace rfsdp::quant
