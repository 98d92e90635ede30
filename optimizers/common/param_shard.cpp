#include "optimizers/common/param_shard.h"

#include <stdexcept>

namespace rfsdp {

void check_grad(const char* optimizer, const ParamShard& p, const at::Tensor& grad) {
  if (grad.defined() && (grad.scalar_type() != at::kFloat || !grad.is_contiguous() ||
                         grad.device() != p.param.device() || grad.numel() != p.param.numel())) {
    throw std::invalid_argument(std::string(optimizer) + ": the gradient of parameter '" +
                                p.name + "' must be a contiguous float32 tensor of " +
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
  ParamShard p;
  p.name = name;
  p.param = param;
  p.grad = grad;
  p.shape = param.sizes().vec();
  int64_t rows = 1;
  for (int d = 0; d < row_dims && d < param.dim(); ++d) rows *= param.size(d);
  p.full_rows = rows;
  p.row_len = rows ? param.numel() / rows : 1;
  return p;
}

std::vector<ParamShard> param_shards(const FSDPUnit& unit) {
  std::vector<ParamShard> out;
  for (size_t i = 0; i < unit.num_params(); ++i) {
    const TensorSpec& t = unit.plan().tensors[i];
    const ShardRange r = unit.shard_range(i);
    ParamShard p;
    p.name = t.name;
    p.param = unit.local_param(i);
    p.grad = unit.local_grad(i);
    p.full_rows = t.rows();
    p.row_len = t.row_elems();
    p.row_begin = r.row_begin;
    p.shape = t.shape;
    out.push_back(p);
  }
  return out;
}

}  // namespace rfsdp
