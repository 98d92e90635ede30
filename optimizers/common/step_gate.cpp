#include "optimizers/common/step_gate.h"

#include <algorithm>
#include <map>
#include <stdexcept>

#include "core/comm/agree.h"
#include "optimizers/common/finite.h"

namespace rfsdp {

namespace {

std::string nonfinite_message(const std::string& name) {
  return "the gradient of parameter '" + name + "' holds NaN or Inf";
}

}  // namespace

StepGate::StepGate(Comm* comm, std::string who)
    : comm_(comm && comm->size() > 1 ? comm : nullptr), who_(std::move(who)) {}

void StepGate::record(Code code, std::string message) {
  // A refusal outranks an error, an error a NaN; of each kind the first is kept.
  if (severity(code_) >= severity(code)) return;
  code_ = code;
  message_ = std::move(message);
}

void StepGate::expect_finite(const at::Tensor& t, std::string message) {
  if (!t.defined() || t.numel() == 0) return;
  if (t.device().is_cpu()) {
    if (code_ == kOk && !tensor_finite(t)) record(kNonFinite, std::move(message));
  } else {
    on_device_.emplace_back(std::move(message), t);
  }
}

void StepGate::check_finite(const std::string& name, const at::Tensor& grad) {
  if (grad.defined()) expect_finite(grad, nonfinite_message(name));
}

void StepGate::fail(const std::string& message, bool invalid_argument) {
  record(invalid_argument ? kInvalid : kError, message);
}

void StepGate::refuse(const std::string& message, bool invalid_argument) {
  record(invalid_argument ? kRefusedInvalid : kRefusedError, message);
}

std::string StepGate::local_message(bool device_nonfinite) const {
  if (code_ != kOk || !device_nonfinite) return message_;
  for (const auto& [message, t] : on_device_) {  // the failure path: one check per tensor
    if (!at::isfinite(t).all().item<bool>()) return message;
  }
  return on_device_.front().first;
}

at::Tensor StepGate::device_nonfinite_flag(const at::Device& dev) const {
  // torch's AMP check (the one GradScaler relies on: one multi-tensor kernel per
  // device and dtype sets a flag for any NaN or Inf, and scales by 1, which
  // changes no value): no host wait.
  if (on_device_.empty()) return at::Tensor();
  std::map<std::pair<std::string, at::ScalarType>, std::vector<at::Tensor>> groups;
  for (const auto& [message, t] : on_device_) groups[{t.device().str(), t.scalar_type()}].push_back(t);
  at::Tensor flag = at::zeros({1}, at::TensorOptions(at::kFloat).device(dev));
  for (auto& [key, ts] : groups) {
    const auto f32 = at::TensorOptions(at::kFloat).device(ts.front().device());
    at::Tensor found = at::zeros({1}, f32);
    at::_amp_foreach_non_finite_check_and_unscale_(ts, found, at::ones({1}, f32));
    flag.add_(found.to(dev));
  }
  return flag;
}

void StepGate::check_device_now() {
  if (on_device_.empty()) return;
  if (code_ == kOk && device_nonfinite_flag(at::kCPU).item<float>() > 0) {
    record(kNonFinite, local_message(true));
  }
  on_device_.clear();
}

void StepGate::agree() {
  // The host waits once, for the codes (device gradients are checked on their device).
  const at::Device dev = comm_ ? comm_->control_device()
                               : (on_device_.empty() ? at::Device(at::kCPU)
                                                     : on_device_.front().second.device());
  at::Tensor mine = at::full({1}, static_cast<int64_t>(code_), at::TensorOptions(at::kLong).device(dev));
  const at::Tensor device_found = device_nonfinite_flag(dev);
  if (device_found.defined()) {
    mine = at::maximum(mine, (device_found > 0).to(at::kLong) * static_cast<int64_t>(kNonFinite));
  }
  const int world = comm_ ? comm_->size() : 1, me = comm_ ? comm_->rank() : 0;
  at::Tensor table = at::zeros({world}, mine.options());
  table.narrow(0, me, 1).copy_(mine);
  if (comm_) comm_->all_reduce(table, ReduceOp::Sum).wait();
  const at::Tensor codes = table.cpu();
  const int64_t* c = codes.data_ptr<int64_t>();
  const int64_t worst = *std::max_element(c, c + world);
  if (worst == kOk) {
    agreed_ = true;
    return;
  }
  // What each rank found: the ranks' messages (a second collective, on failure only).
  const bool device_nonfinite = c[me] == kNonFinite && code_ == kOk;
  const std::string msg = c[me] != kOk ? local_message(device_nonfinite) : std::string();
  const std::vector<std::string> messages =
      comm_ ? all_gather_strings(*comm_, msg) : std::vector<std::string>{msg};
  int first = -1, n_others = 0;
  std::string others;
  for (int r = 0; r < world; ++r) {
    if (c[r] == worst && first < 0) {
      first = r;
    } else if (c[r] != kOk) {
      others += (others.empty() ? "" : ", ") + std::to_string(r);
      ++n_others;
    }
  }
  std::string text = who_ + ": " + messages[first];
  if (comm_) {
    text += " (on rank " + std::to_string(first) +
            (n_others == 0 ? "" : (n_others == 1 ? "; rank " : "; ranks ") + others + " failed too") +
            "); the step was not taken on any rank";
  } else {
    text += "; the step was not taken";
  }
  if (worst == kNonFinite) text += " (check the loss, lower the learning rate, or clip gradients)";
  if (worst == kInvalid || worst == kRefusedInvalid) throw std::invalid_argument(text);
  throw std::runtime_error(text);
}

}  // namespace rfsdp
