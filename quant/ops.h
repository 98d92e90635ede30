// The one front door into quant: what optimizers/, fsdp/, python/bindings and the
// package's users include for everything they take from it. quant/ is three layers:
//   formats/  what a quantised tensor is: the code maps, their lookup tables and the
//             arithmetic code index, the block layout, the absmax bits;
//   kernels/  the loops, by instruction set and device: cpu/ (portable, AVX2,
//             AVX-512 and the dispatch between them), cuda/, aten/ (the
//             device-generic path), and the AdamW update they all round alike;
//   ops/      the entry layer that picks a kernel for a tensor's device: blockwise
//             (de)quantisation, the 8-bit optimizer states, the low-bit (4-bit)
//             formats, the absmax codes of the quantised gather, the device switch.
// Tests and benches of the kernels include kernels/ and formats/ headers directly.
#pragma once

#include "quant/formats/block_layout.h"
#include "quant/formats/code_lut.h"
#include "quant/formats/code_maps.h"
#include "quant/kernels/cpu/kernels.h"
#include "quant/kernels/cuda/ops.h"
#include "quant/ops/absmax_codes.h"
#include "quant/ops/blockwise.h"
#include "quant/ops/device_path.h"
#include "quant/ops/lowbit.h"
#include "quant/ops/state_ops.h"
