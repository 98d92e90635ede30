#include "fsdp/fp32_sum_reduce.h"

#include <ATen/core/grad_mode.h>

#include <vector>

namespace rfsdp {

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
      .then([recv, out, m, S] { sum_in_rank_order(recv.view({m, S}), out); });  // wire -> fp32: exact
}

CommHandle all_reduce_summed_in_fp32(Comm& comm, const at::Tensor& slice, at::ScalarType wire) {
  at::NoGradGuard no_grad;
  const int64_t m = comm.size(), S = slice.numel();
  const at::Tensor all = at::empty({m * S}, slice.options().dtype(wire));
  all.narrow(0, comm.rank() * S, S).copy_(slice);
  return comm.all_gather_flat(all.view(at::kByte)).then([all, slice, m, S] {
    sum_in_rank_order(all.view({m, S}), slice);
  });
}

}  // namespace rfsdp
