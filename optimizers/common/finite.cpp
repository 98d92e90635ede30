#include "optimizers/common/finite.h"

#include "quant/blockwise/cpu_kernels.h"

namespace rfsdp {

bool all_ranks_finite(Comm* comm, const std::vector<at::Tensor>& tensors) {
  float bad = 0.0f;
  for (const auto& t : tensors) {
    if (t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous()) {
      if (!quant::cpu::all_finite(t.data_ptr<float>(), t.numel())) bad = 1.0f;
    } else if (!at::isfinite(t).all().item<bool>()) {
      bad = 1.0f;
    }
  }
  if (comm && comm->size() > 1) {
    const at::Device dev = tensors.empty() ? at::Device(at::kCPU) : tensors[0].device();
    at::Tensor flag = at::full({1}, bad, at::TensorOptions(at::kFloat).device(dev));
    comm->all_reduce(flag, ReduceOp::Sum).wait();
    bad = flag.item<float>();
  }
  return bad == 0.0f;
}

}  // namespace rfsdp
