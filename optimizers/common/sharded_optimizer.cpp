#include "optimizers/common/sharded_optimizer.h"

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include <stdexcept>

#include "core/ragged/tensor_spec.h"

namespace rfsdp {

namespace {

// Throws unless `param` can be parameter p's tensor: a float32, bfloat16 or
// float16 contiguous tensor on the CPU or a GPU with the shard's elements.
void check_param(const char* name, const ParamShard& p, const at::Tensor& param) {
  const std::string who = std::string(name) + ": parameter '" + p.name + "' ";
  if (param.defined() && !is_parameter_dtype(param.scalar_type())) {
    throw std::invalid_argument(
        who + "is a " + c10::toString(param.scalar_type()) + " tensor; the optimizers keep "
        "float32 state and step float32, bfloat16 or float16 parameters (computing in float32). "
        "Cast the model to one of those (model.float(), or model.to(torch.bfloat16)); for "
        "float32 masters with bfloat16 compute, keep float32 parameters and use a "
        "MixedPrecisionPolicy (rfsdp.fully_shard's or FSDP2's)");
  }
  if (!param.defined() || !param.is_contiguous() ||
      !(param.device().is_cpu() || param.device().is_cuda())) {
    throw std::invalid_argument(
        who + "must be a contiguous float32, bfloat16 or float16 tensor on the CPU or a CUDA "
        "device; got " +
        (!param.defined() ? std::string("none")
                          : std::string(param.is_contiguous() ? "" : "a non-contiguous ") +
                                c10::toString(param.scalar_type()) + " tensor on " +
                                param.device().str()));
  }
  if (p.row_len == 0) {  // (0 rows are fine: a rank's empty shard is one)
    throw std::invalid_argument(
        std::string(name) + ": parameter '" + p.name + "' has 0 elements (shape " +
        shape_to_string(p.shape) + "): the optimizers keep state by rows, and its rows are "
        "empty; leave it out of the optimizer (it has nothing to update: torch.optim's step "
        "skips it)");
  }
  if (p.row_len < 1 || p.row_begin < 0 || p.row_begin > p.row_end || p.row_end > p.full_rows ||
      param.numel() != p.numel()) {
    throw std::invalid_argument(who + "holds " + std::to_string(param.numel()) +
                                " elements, but its shard is rows [" +
                                std::to_string(p.row_begin) + ", " + std::to_string(p.row_end) +
                                ") of " + std::to_string(p.row_len) + " elements of a tensor of " +
                                std::to_string(p.full_rows) + " rows");
  }
}

}  // namespace

std::string number_text(double v) {
  char text[32];
  for (int digits = 6; digits <= 17; ++digits) {  // the fewest that read back as v
    std::snprintf(text, sizeof text, "%.*g", digits, v);
    if (std::strtod(text, nullptr) == v) break;
  }
  return text;
}

void check_option(const std::string& who, const std::string& name, double v, bool ok,
                  const std::string& rule) {
  if (!std::isfinite(v) || !ok) {
    throw std::invalid_argument(who + ": " + name + " must be " +
                                (std::isfinite(v) ? "" : "finite and ") + rule + ", got " +
                                number_text(v));
  }
}

ShardedOptimizer::ShardedOptimizer(const char* name, std::vector<ParamShard> params,
                                   std::shared_ptr<Comm> comm, bool check_finite)
    : params_(std::move(params)),
      comm_(std::move(comm)),
      check_finite_(check_finite),
      group_of_(params_.size(), 0),
      param_steps_(params_.size(), 0) {
  for (const ParamShard& p : params_) {
    check_param(name, p, p.param);
    check_grad(name, p, p.grad);  // a gradient given with the parameter; undefined passes
  }
}

void ShardedOptimizer::set_param(size_t i, const at::Tensor& param) {
  if (i >= params_.size()) {
    throw std::out_of_range(std::string(name()) + ": parameter " + std::to_string(i) + " of " +
                            std::to_string(params_.size()));
  }
  ParamShard& p = params_[i];
  check_param(name(), p, param);
  if (param.device() != p.param.device()) {
    throw std::invalid_argument(std::string(name()) + ": " + who(i) + " moved from " +
                                p.param.device().str() + " to " + param.device().str() +
                                ", and its optimizer state lives on " + p.param.device().str() +
                                "; build the optimizer where the parameters are (rfsdp.optim's "
                                "optimizers move their state with the parameters)");
  }
  p.param = param;
  p.grad = at::Tensor();  // a gradient set for the old tensor is not this one's
}

void ShardedOptimizer::set_rounding(Rounding r, uint64_t seed) {
  rounding_ = r;
  rounding_seed_ = seed;
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

void ShardedOptimizer::reset_state(size_t i) {
  if (i >= params_.size()) {
    throw std::out_of_range(std::string(name()) + ": parameter " + std::to_string(i) + " of " +
                            std::to_string(params_.size()));
  }
  clear_state(i);
  param_steps_[i] = 0;
}

void ShardedOptimizer::set_step_count(size_t i, int64_t n) {
  if (n < 0) {
    throw std::invalid_argument(std::string(name()) + ": " + who(i) + ": a step count of " +
                                std::to_string(n));
  }
  param_steps_.at(i) = n;
}

void ShardedOptimizer::run_step_in_fp32(StepGate& gate, const std::vector<size_t>& stepping) {
  struct Stored {
    size_t i;
    at::Tensor param, grad;  // the caller's tensors, back in place after the step
  };
  std::vector<Stored> stored;
  for (size_t i : stepping) {
    ParamShard& p = params_[i];
    if (!is_low_precision(p.param.scalar_type())) continue;
    stored.push_back({i, p.param, p.grad});
    p.param = p.param.to(at::kFloat);
    p.grad = p.grad.to(at::kFloat);
  }
  auto restore = [&] {
    for (const Stored& s : stored) {
      params_[s.i].param = s.param;
      params_[s.i].grad = s.grad;
    }
  };
  try {
    run_step(gate, stepping);
  } catch (...) {
    restore();
    throw;
  }
  for (const Stored& s : stored) {
    const ParamShard& p = params_[s.i];
    // salt: the parameter's place among the optimizer's; counter: its step; the
    // element index: its place in the global tensor (replicas agree)
    round_into(s.param, p.param, rounding_, rounding_seed_, s.i, param_steps_[s.i],
               p.row_begin * p.row_len);
  }
  restore();
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
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!checks_own_gradient(i)) gate.check_finite(params_[i].name, params_[i].grad);
    }
  }
  std::vector<size_t> stepping;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].grad.defined()) stepping.push_back(i);
  }
  // run_step sees the counts of the step it takes; a step stopped at the gate
  // (nothing changed anywhere) leaves them as they were.
  for (size_t i : stepping) ++param_steps_[i];
  // The metrics' start: the clock, the Comm's bytes, and (tracked) the parameters
  // as they are, in float32, to measure the update by what the step changed.
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t bytes0 = comm_ ? comm_->stats().bytes_sent : 0;
  std::vector<StepMetrics::Group> work(num_groups_);
  work_.swap(work);
  std::vector<at::Tensor> before;
  if (track_update_) {
    for (size_t i : stepping) before.push_back(params_[i].param.to(at::kFloat, false, /*copy=*/true));
  }
  try {
    run_step_in_fp32(gate, stepping);
  } catch (...) {
    work_.swap(work);  // (the last step's stay what metrics() shows)
    if (!gate.agreed()) {
      for (size_t i : stepping) --param_steps_[i];
    }
    throw;
  }
  ++steps_;
  update_numel_.assign(num_groups_, 0);
  update_sq_ = at::Tensor();
  if (track_update_ && !stepping.empty()) {
    update_sq_ = at::zeros({static_cast<int64_t>(num_groups_)},
                           params_[stepping[0]].param.options().dtype(at::kDouble));
    // (multi-tensor kernels: a constant number of launches, norms accumulated in float64)
    std::vector<at::Tensor> now;
    std::vector<int64_t> groups;
    for (size_t i : stepping) {
      now.push_back(params_[i].param.to(at::kFloat));
      groups.push_back(static_cast<int64_t>(group_of_[i]));
      update_numel_[group_of_[i]] += params_[i].param.numel();
    }
    const std::vector<at::Tensor> norms =
        at::_foreach_norm(at::_foreach_sub(now, before), 2, at::kDouble);
    std::vector<at::Tensor> on_device;
    for (const at::Tensor& n : norms) on_device.push_back(n.to(update_sq_.device()));
    update_sq_.index_add_(0, at::tensor(groups, at::kLong).to(update_sq_.device()),
                          at::stack(on_device).square());
  }
  metrics_step_ = steps_;
  bytes_sent_ = (comm_ ? comm_->stats().bytes_sent : 0) - bytes0;
  seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

ShardedOptimizer::StepMetrics ShardedOptimizer::metrics(bool across_ranks) const {
  StepMetrics m;
  m.step = metrics_step_;
  m.update_tracked = update_sq_.defined();
  const size_t G = work_.size();
  m.groups.assign(G, {});
  // [matrices, tiles, roots, update_sq, update_numel] per group, the bytes, the time
  std::vector<double> v(G * 5 + 2, 0.0);
  const at::Tensor sq = update_sq_.defined() ? update_sq_.cpu() : at::Tensor();
  for (size_t g = 0; g < G; ++g) {
    v[g * 5 + 0] = static_cast<double>(work_[g].matrices);
    v[g * 5 + 1] = static_cast<double>(work_[g].tiles);
    v[g * 5 + 2] = static_cast<double>(work_[g].roots);
    v[g * 5 + 3] = sq.defined() ? sq[static_cast<int64_t>(g)].item<double>() : 0.0;
    v[g * 5 + 4] = g < update_numel_.size() ? static_cast<double>(update_numel_[g]) : 0.0;
  }
  v[G * 5] = static_cast<double>(bytes_sent_);
  m.bytes_sent = bytes_sent_;
  m.seconds = m.seconds_max = seconds_;
  if (across_ranks && comm_ && comm_->size() > 1) {
    // One all-reduce: the sums, and the slowest time as a sum of one rank's value
    // (a second, max, reduce would cost a round): every rank adds its time to its own
    // slot of a table, so each sees every rank's.
    const int n = comm_->size();
    std::vector<double> all(v.size() + n, 0.0);
    std::copy(v.begin(), v.end(), all.begin());
    all[v.size() + comm_->rank()] = seconds_;
    at::Tensor t = at::tensor(all, at::TensorOptions().dtype(at::kDouble)).to(comm_->control_device());
    comm_->all_reduce(t, ReduceOp::Sum).wait();
    t = t.cpu();
    const double* r = t.data_ptr<double>();
    std::copy(r, r + v.size(), v.begin());
    m.seconds_max = *std::max_element(r + v.size(), r + v.size() + n);
  }
  for (size_t g = 0; g < G; ++g) {
    m.groups[g].matrices = static_cast<int64_t>(std::llround(v[g * 5 + 0]));
    m.groups[g].tiles = static_cast<int64_t>(std::llround(v[g * 5 + 1]));
    m.groups[g].roots = static_cast<int64_t>(std::llround(v[g * 5 + 2]));
    m.groups[g].update_sq = v[g * 5 + 3];
    m.groups[g].update_numel = static_cast<int64_t>(std::llround(v[g * 5 + 4]));
  }
  m.bytes_sent_total = static_cast<int64_t>(std::llround(v[G * 5]));
  return m;
}

void ShardedOptimizer::step_refused(const std::string& message, bool invalid_argument) {
  StepGate gate(comm_.get(), std::string(name()) + " step");
  gate.refuse(message, invalid_argument);
  run_step_in_fp32(gate, {});
  gate.agree();  // (where run_step did not reach it) throws the agreed error
  throw std::logic_error("step_refused: the gate let a refused step through");
}

NamedState ShardedOptimizer::saved_as_kept(size_t i, const NamedState& full,
                                           const std::vector<std::string>& names) const {
  const auto live = state(i);
  const auto layouts = state_layout(i);
  const ParamShard& p = params_.at(i);
  NamedState out;
  for (const std::string& n : names) {
    const auto t = std::find_if(live.begin(), live.end(), [&](const auto& x) { return x.first == n; });
    const auto l = std::find_if(layouts.begin(), layouts.end(), [&](const auto& x) { return x.name == n; });
    if (t == live.end() || l == layouts.end()) {
      throw std::logic_error(std::string(name()) + ": no state '" + n + "' of parameter '" + p.name + "'");
    }
    const at::Tensor& whole = saved(full, n, name(), p);
    out[n] = l->kind == StateLayout::Kind::kRows ? rows_here(p, whole).view(t->second.sizes())
                                                 : piece_here(whole, *l, t->second.numel());
  }
  return out;
}

}  // namespace rfsdp
