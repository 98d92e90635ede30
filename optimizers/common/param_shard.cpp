#include "optimizers/common/param_shard.h"

#include <algorithm>
#include <stdexcept>

#include "core/comm/comm.h"

namespace rfsdp {

void check_grad(const char* optimizer, const ParamShard& p, const at::Tensor& grad) {
  if (grad.defined() && grad.layout() != at::kStrided) {  // (is_contiguous() is false there)
    throw std::invalid_argument(std::string(optimizer) + ": the gradient of parameter '" + p.name +
                                "' is a " + c10::str(grad.layout()) +
                                " tensor: sparse gradients are not supported (nn.Embedding and "
                                "nn.EmbeddingBag make them with sparse=True: use sparse=False)");
  }
  if (grad.defined() &&
      ((grad.scalar_type() != at::kFloat && grad.scalar_type() != p.param.scalar_type()) ||
       !grad.is_contiguous() || grad.device() != p.param.device() ||
       grad.numel() != p.param.numel())) {
    throw std::invalid_argument(std::string(optimizer) + ": the gradient of parameter '" +
                                p.name + "' must be a contiguous float32 " +
                                (p.param.scalar_type() == at::kFloat
                                     ? std::string()
                                     : std::string("(or ") + c10::toString(p.param.scalar_type()) +
                                           ", the parameter's dtype) ") +
                                "tensor of " +
                                std::to_string(p.param.numel()) + " elements on " +
                                p.param.device().str() + " (the parameter's device); got " +
                                (grad.is_contiguous() ? "" : "a non-contiguous tensor of ") +
                                std::to_string(grad.numel()) + " " +
                                c10::toString(grad.scalar_type()) + " elements on " +
                                grad.device().str());
  }
}

ParamShard whole_param(const std::string& name, const at::Tensor& param, const at::Tensor& grad,
                       int row_dims) {
  return ParamShard(TensorShard::whole(name, param.sizes().vec(), row_dims), param, grad);
}

void require_own_rows(const char* optimizer, const TensorShard& p, const char* what) {
  if (p.col_parts > 1) {
    throw std::invalid_argument(
        std::string(optimizer) + ": parameter '" + p.name + "' is held in " +
        std::to_string(p.col_parts) + " column parts (tensor parallelism's Shard(1), as "
        "RowwiseParallel leaves it): its " + what + " are not supported there yet; give it to "
        "an optimizer of its own that takes column parts (rfsdp.optim.AdamW, AdamW8bit, or Muon "
        "with momentum_dtype torch.float32 or torch.bfloat16), or shard it along dim 0 "
        "(ColwiseParallel)");
  }
}

void gather_rank_rows(Comm* comm, std::vector<ParamShard>* params, const char* who) {
  const int world = comm ? comm->size() : 1;
  const int rank = comm ? comm->rank() : 0;
  const bool known = std::all_of(params->begin(), params->end(), [&](const ParamShard& p) {
    return static_cast<int>(p.rank_rows.size()) == world;
  });
  if (known) return;
  if (world == 1) {
    // Alone, a shard's rows are every rank's only where it holds them all; a
    // part described by hand keeps none (its consumer names what it lacks).
    for (ParamShard& p : *params) {
      if (p.rank_rows.empty() && p.row_begin == 0 && p.row_end == p.full_rows) {
        p.rank_rows = {{p.row_begin, p.row_end}};
      }
    }
    return;
  }
  // A table where each rank fills its row (its count, then its rows of each
  // parameter), summed: every rank's rows everywhere.
  const int64_t P = static_cast<int64_t>(params->size());
  at::Tensor table = at::zeros({world, 1 + 2 * P}, at::kLong);
  auto t = table.accessor<int64_t, 2>();
  t[rank][0] = P;
  for (int64_t i = 0; i < P; ++i) {
    t[rank][1 + 2 * i] = (*params)[i].row_begin;
    t[rank][2 + 2 * i] = (*params)[i].row_end;
  }
  at::Tensor shared = table.to(comm->control_device());  // NCCL takes no CPU tensors
  comm->all_reduce(shared, ReduceOp::Sum).wait();
  table.copy_(shared.cpu());
  for (int r = 0; r < world; ++r) {
    if (t[r][0] != P) {
      throw std::invalid_argument(std::string(who) + ": rank " + std::to_string(r) + " has " +
                                  std::to_string(t[r][0]) + " parameters and rank " +
                                  std::to_string(rank) + " " + std::to_string(P) +
                                  "; build the optimizer from the same model on every rank");
    }
  }
  for (int64_t i = 0; i < P; ++i) {
    ParamShard& p = (*params)[i];
    // (rows known for this group are kept: their consumer agrees them; rows known
    // for another group, an HSDP shard group's, are this group's no more)
    if (static_cast<int>(p.rank_rows.size()) == world) continue;
    p.rank_rows.clear();
    for (int r = 0; r < world; ++r) p.rank_rows.emplace_back(t[r][1 + 2 * i], t[r][2 + 2 * i]);
  }
}

}  // namespace rfsdp
