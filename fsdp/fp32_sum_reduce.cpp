#include "fsdp/fp32_sum_reduce.h"

#include <ATen/core/grad_mode.h>

#include <vector>

namespace rfsdp {

namespace {

// out <- pieces[0] + pieces[1] + ... in fp32, in order (pieces: [m, S] in wire).
void add_in_order(const at::Tensor& pieces, const at::Tensor& out) {
  out.copy_(pieces[0]);
  for (int64_t r = 1; r < pieces.size(0); ++r) out.add_(pieces[r]);  // (wire -> fp32 is exact)
}

}  // namespace

CommHandle reduce_scatter_summed_in_fp32(Comm& comm, const at::Tensor& buffer,
                                         const at::Tensor& out, at::ScalarType wire) {
  at::NoGradGuard no_grad;
  const int64_t m = comm.size(), S = out.numel();
  const at::Tensor send = buffer.to(wire).contiguous();
  const at::Tensor recv = at::empty({m * S}, send.options());
  // Every backend moves bytes: the pieces travel as their bytes.
  const int64_t bytes = S * static_cast<int64_t>(send.element_size());
  const std::vector<int64_t> splits(m, bytes);
  return comm.all_to_all(recv.view(at::kByte), send.view(at::kByte), splits, splits)
      .then([recv, out, m, S] { add_in_order(recv.view({m, S}), out); });
}

CommHandle all_reduce_summed_in_fp32(Comm& comm, const at::Tensor& slice, at::ScalarType wire) {
  at::NoGradGuard no_grad;
  const int64_t m = comm.size(), S = slice.numel();
  const at::Tensor all = at::empty({m * S}, slice.options().dtype(wire));
  all.narrow(0, comm.rank() * S, S).copy_(slice);
  return comm.all_gather_flat(all.view(at::kByte)).then([all, slice, m, S] {
    add_in_order(all.view({m, S}), slice);
  });
}

}  // namespace rfsdp
