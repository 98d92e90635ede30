#include "optimizers/common/sharded_optimizer.h"

#include <stdexcept>

namespace rfsdp {

ShardedOptimizer::ShardedOptimizer(const char* name, std::vector<ParamShard> params,
                                   std::shared_ptr<Comm> comm, bool check_finite)
    : params_(std::move(params)),
      comm_(std::move(comm)),
      check_finite_(check_finite),
      group_of_(params_.size(), 0),
      param_steps_(params_.size(), 0) {
  for (const ParamShard& p : params_) {
    const std::string who = std::string(name) + ": parameter '" + p.name + "' ";
    if (!p.param.defined() || p.param.scalar_type() != at::kFloat || !p.param.is_contiguous() ||
        !(p.param.device().is_cpu() || p.param.device().is_cuda())) {
      throw std::invalid_argument(
          who + "must be a contiguous float32 tensor on the CPU or a CUDA device; got " +
          (!p.param.defined() ? std::string("none")
                              : std::string(p.param.is_contiguous() ? "" : "a non-contiguous ") +
                                    c10::toString(p.param.scalar_type()) + " tensor on " +
                                    p.param.device().str()));
    }
    if (p.row_len < 1 || p.row_begin < 0 || p.row_begin > p.row_end || p.row_end > p.full_rows ||
        p.param.numel() != p.numel()) {
      throw std::invalid_argument(who + "holds " + std::to_string(p.param.numel()) +
                                  " elements, but its shard is rows [" +
                                  std::to_string(p.row_begin) + ", " + std::to_string(p.row_end) +
                                  ") of " + std::to_string(p.row_len) + " elements of a tensor of " +
                                  std::to_string(p.full_rows) + " rows");
    }
    check_grad(name, p, p.grad);  // a gradient given with the parameter; undefined passes
  }
}

std::string ShardedOptimizer::who(size_t i) const { return "parameter '" + params_.at(i).name + "'"; }

void ShardedOptimizer::check_grad_of(size_t i, const at::Tensor& grad) const {
  check_grad(name(), params_.at(i), grad);
}

void ShardedOptimizer::set_grad(size_t i, const at::Tensor& grad) {
  if (i >= params_.size()) {
    throw std::out_of_range(std::string(name()) + ": parameter " + std::to_string(i) + " of " +
                            std::to_string(params_.size()));
  }
  check_grad_of(i, grad);
  params_[i].grad = grad;
}

void ShardedOptimizer::set_grads(const std::vector<at::Tensor>& grads) {
  if (grads.size() != params_.size()) {
    throw std::invalid_argument(std::string(name()) + ": " + std::to_string(grads.size()) +
                                " gradients for " + std::to_string(params_.size()) + " parameters");
  }
  for (size_t i = 0; i < grads.size(); ++i) check_grad_of(i, grads[i]);
  for (size_t i = 0; i < grads.size(); ++i) params_[i].grad = grads[i];
}

void ShardedOptimizer::set_groups(const std::vector<size_t>& group_of) {
  if (group_of.size() != params_.size()) {
    throw std::invalid_argument(std::string(name()) + ": " + std::to_string(group_of.size()) +
                                " group indices for " + std::to_string(params_.size()) +
                                " parameters");
  }
  size_t n = 1;
  for (size_t g : group_of) n = std::max(n, g + 1);
  group_of_ = group_of;
  num_groups_ = n;
  resize_groups(n);
}

void ShardedOptimizer::set_step_count(size_t i, int64_t n) {
  if (n < 0) {
    throw std::invalid_argument(std::string(name()) + ": " + who(i) + ": a step count of " +
                                std::to_string(n));
  }
  param_steps_.at(i) = n;
}

int64_t ShardedOptimizer::state_bytes() const {
  int64_t b = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    for (const auto& [name, t] : state(i)) b += t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
  }
  return b;
}

void ShardedOptimizer::step() {
  StepGate gate(comm_.get(), std::string(name()) + " step");
  if (check_finite_) {
    for (const auto& p : params_) gate.check_finite(p.name, p.grad);
  }
  std::vector<size_t> stepping;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].grad.defined()) stepping.push_back(i);
  }
  // run_step sees the counts of the step it takes; a step stopped at the gate
  // (nothing changed anywhere) leaves them as they were.
  for (size_t i : stepping) ++param_steps_[i];
  try {
    run_step(gate, stepping);
  } catch (...) {
    if (!gate.agreed()) {
      for (size_t i : stepping) --param_steps_[i];
    }
    throw;
  }
  ++steps_;
}

}  // namespace rfsdp
