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

void StepGate::expect_finite(const at::Tensor& t, std::string message, bool derived) {
  if (!t.defined() || t.numel() == 0) return;
  const Code code = derived ? kDerivedNonFinite : kNonFinite;
  if (t.device().is_cpu()) {
    if (severity(code_) < severity(code) && !tensor_finite(t)) record(code, std::move(message));
  } else {
    on_device_.push_back({std::move(message), t, derived});
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
  if (!device_nonfinite) return message_;
  // the failure path: one check per tensor, gradients (not derived) first
  for (const bool derived : {false, true}) {
    for (const OnDevice& d : on_device_) {
      if (d.derived == derived && !at::isfinite(d.t).all().item<bool>()) return d.message;
    }
  }
  return on_device_.front().message;
}

at::Tensor StepGate::device_code(const at::Device& dev) const {
  // torch's AMP check (the one GradScaler relies on: one multi-tensor kernel per
  // device and dtype sets a flag for any NaN or Inf, and scales by 1, which
  // changes no value): no host wait.
  if (on_device_.empty()) return at::Tensor();
  at::Tensor code = at::zeros({1}, at::TensorOptions(at::kLong).device(dev));
  for (const bool derived : {false, true}) {
    std::map<std::pair<std::string, at::ScalarType>, std::vector<at::Tensor>> groups;
    for (const OnDevice& d : on_device_) {
      if (d.derived == derived) groups[{d.t.device().str(), d.t.scalar_type()}].push_back(d.t);
    }
    if (groups.empty()) continue;
    at::Tensor flag = at::zeros({1}, at::TensorOptions(at::kFloat).device(dev));
    for (auto& [key, ts] : groups) {
      const auto f32 = at::TensorOptions(at::kFloat).device(ts.front().device());
      at::Tensor found = at::zeros({1}, f32);
      at::_amp_foreach_non_finite_check_and_unscale_(ts, found, at::ones({1}, f32));
      flag.add_(found.to(dev));
    }
    code = at::maximum(code, (flag > 0).to(at::kLong) *
                                 static_cast<int64_t>(derived ? kDerivedNonFinite : kNonFinite));
  }
  return code;
}

void StepGate::check_device_now() {
  if (on_device_.empty()) return;
  const auto found = static_cast<Code>(device_code(at::kCPU).item<int64_t>());
  if (found != kOk && severity(code_) < severity(found)) record(found, local_message(true));
  on_device_.clear();
}

void StepGate::agree() {
  // The host waits once, for the codes (device gradients are checked on their device).
  const at::Device dev = comm_ ? comm_->control_device()
                               : (on_device_.empty() ? at::Device(at::kCPU)
                                                     : on_device_.front().t.device());
  at::Tensor mine = at::full({1}, static_cast<int64_t>(code_), at::TensorOptions(at::kLong).device(dev));
  const at::Tensor device_found = device_code(dev);
  // (a device NaN outranks this rank's code where it is more severe)
  if (device_found.defined()) mine = at::maximum(mine, device_found);
  const int world = comm_ ? comm_->size() : 1, me = comm_ ? comm_->rank() : 0;
  const int64_t n_counts = counts_ ? static_cast<int64_t>(counts_->size()) : 0;
  at::Tensor table = at::zeros({world + n_counts}, mine.options());
  table.narrow(0, me, 1).copy_(mine);
  if (n_counts) {
    table.narrow(0, world, n_counts)
        .copy_(at::tensor(*counts_, at::TensorOptions(at::kLong)).to(table.device()));
  }
  if (comm_) comm_->all_reduce(table, ReduceOp::Sum).wait();
  const at::Tensor all = table.cpu();
  if (n_counts) {
    const int64_t* s = all.data_ptr<int64_t>() + world;
    std::copy(s, s + n_counts, counts_->begin());
  }
  const int64_t* c = all.data_ptr<int64_t>();
  const int64_t worst = *std::max_element(c, c + world);
  if (worst == kOk) {
    agreed_ = true;
    return;
  }
  // What each rank found: the ranks' messages (a second collective, on failure only).
  const bool from_device = c[me] != code_;  // the device tensors' code won
  const std::string msg = c[me] != kOk ? local_message(from_device) : std::string();
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
  if (worst == kNonFinite || worst == kDerivedNonFinite) {
    text += " (check the loss, lower the learning rate, or clip gradients)";
  }
  if (worst == kInvalid || worst == kRefusedInvalid) throw std::invalid_argument(text);
  throw std::runtime_error(text);
}

}  // namespace rfsdp
