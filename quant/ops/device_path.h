// Which implementation runs rfsdp's quantised operations on a tensor: the fast
// kernels of its device (CPU: quant/kernels/cpu/kernels.h; CUDA: cuda/ops.h),
// or the device-generic path (ATen operations only: generic_ops.h here, and the
// weights' absmax codes of fsdp/quantized_gather). A device with no kernel for
// an operation takes the generic path; use_device_generic_path(true), or the
// environment's RFSDP_DEVICE_GENERIC=1 at load, sends every device there, so the
// CPU tests run (and bit-compare) what only a GPU would otherwise run.
#pragma once

namespace rfsdp::quant {

bool device_generic_path();
void use_device_generic_path(bool on);

}  // namespace rfsdp::quant
