#include "optimizers/common/param_shard.h"

#include <stdexcept>

namespace rfsdp {

void check_grad(const char* optimizer, const ParamShard& p, const at::Tensor& grad) {
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

}  // namespace rfsdp
