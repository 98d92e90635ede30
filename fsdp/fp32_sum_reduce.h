// Gradients that travel in a narrow dtype (CommPolicy gradients=bfloat16) and
// are summed in fp32 by the rank that keeps them: never a sum in the narrow
// dtype (as a bf16 reduce-scatter does, which rounds at every addition).
#pragma once

#include <ATen/ATen.h>

#include "core/comm/comm.h"

namespace rfsdp {

// buffer: m*S elements (any floating dtype; cast to `wire` for the trip); out:
// S fp32 elements, written with the sum over ranks of their slice `rank`, each
// piece rounded to `wire`, added in rank order in fp32 (one all-to-all of
// equal pieces, then m-1 additions). Collective.
CommHandle reduce_scatter_summed_in_fp32(Comm& comm, const at::Tensor& buffer,
                                         const at::Tensor& out, at::ScalarType wire);

// slice: fp32, on every rank of `comm` (HSDP's replicas); becomes the sum of
// every rank's slice rounded to `wire`, added in rank order in fp32 (one
// all-gather): equal on every rank. Collective.
CommHandle all_reduce_summed_in_fp32(Comm& comm, const at::Tensor& slice, at::ScalarType wire);

}  // namespace rfsdp
