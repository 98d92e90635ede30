#include "fsdp/grad_clip.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace rfsdp {

double clip_grad_norm(const std::vector<FSDPUnit*>& units, double max_norm,
                      bool error_if_nonfinite) {
  if (units.empty()) throw std::invalid_argument("clip_grad_norm: no units given");
  if (!(max_norm > 0)) throw std::invalid_argument("clip_grad_norm: max_norm must be positive");
  Comm& comm = units.front()->comm();
  for (FSDPUnit* u : units) {
    if (&u->comm() != &comm && u->comm().process_group() != comm.process_group()) {
      throw std::invalid_argument("clip_grad_norm: the units do not share one process group");
    }
  }
  // Padding in the slices is zero, so whole slices can be summed.
  // The sum lives where the group's collectives take it (NCCL: the GPU).
  at::Tensor sq = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(
                                     units.front()->device().is_cpu() ? comm.control_device()
                                                                      : units.front()->device()));
  for (FSDPUnit* u : units) sq += u->local_grad_slice().to(sq.device(), at::kDouble).pow(2).sum();
  comm.all_reduce(sq, ReduceOp::Sum).wait();
  const double norm = std::sqrt(sq.item<double>());
  if (!std::isfinite(norm) && error_if_nonfinite) {
    // Name a tensor of this rank that holds them, if one does.
    std::string where = "another rank's shard holds them";
    bool found = false;
    for (size_t k = 0; k < units.size() && !found; ++k) {
      for (size_t i = 0; i < units[k]->num_params() && !found; ++i) {
        if (!units[k]->local_grad(i).isfinite().all().item<bool>()) {
          where = "unit " + std::to_string(k) + " tensor '" + units[k]->plan().tensors[i].name +
                  "' holds them on rank " + std::to_string(comm.rank());
          found = true;
        }
      }
    }
    throw std::runtime_error("clip_grad_norm: the gradient norm is " + std::to_string(norm) +
                             ": gradients have NaN or Inf values (" + where +
                             "); lower the learning rate or check the loss, or pass "
                             "error_if_nonfinite=false to clip anyway");
  }
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    for (FSDPUnit* u : units) u->local_grad_slice().mul_(coef);
  }
  return norm;
}

}  // namespace rfsdp
