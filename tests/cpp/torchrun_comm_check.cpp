// Launched by torchrun (see tests/CMakeLists.txt): each process starts Comm
// from the environment and checks an all-gather, a reduce-scatter and an
// all-reduce against values it can compute for every rank. Exit 0 = pass.
#include <iostream>

#include "core/comm/comm.h"

int main() {
  try {
    auto comm = rfsdp::Comm::from_env(std::chrono::seconds(60), "gloo");  // CPU tensors
    const int r = comm->rank(), m = comm->size();
    const int64_t S = 10;
    at::Tensor buf = at::zeros({m * S});
    comm->all_gather_flat(buf, at::full({S}, static_cast<float>(r + 1))).wait();
    for (int k = 0; k < m; ++k) {
      if (!buf.narrow(0, k * S, S).eq(k + 1).all().item<bool>()) throw std::runtime_error("gather");
    }
    at::Tensor grads = at::arange(m * S, at::kFloat) * (r + 1), out = at::zeros({S});
    comm->reduce_scatter_flat(grads, out, rfsdp::ReduceOp::Sum).wait();
    const float ranks_sum = m * (m + 1) / 2.0f;
    if (!at::equal(out, at::arange(r * S, (r + 1) * S, at::kFloat) * ranks_sum)) {
      throw std::runtime_error("reduce_scatter");
    }
    at::Tensor t = at::full({3}, static_cast<float>(r));
    comm->all_reduce(t, rfsdp::ReduceOp::Avg).wait();
    if (!t.eq((m - 1) / 2.0f).all().item<bool>()) throw std::runtime_error("all_reduce");
    std::cout << "rank " << r << " of " << m << " ok (" << comm->backend_name() << ")\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "torchrun_comm_check: " << e.what() << "\n";
    return 1;
  }
}
