// The gate every optimizer step passes before it changes anything: what this
// rank found (a NaN/Inf gradient, a root that failed, an error thrown while the
// step was prepared) is agreed by every rank in one all-reduce of a code per
// rank, and if any rank found something, every rank throws the same error,
// naming the rank and what it found (their messages travel only then). Nothing
// has changed anywhere, and a later step works again. A rank that raised alone
// would leave the others waiting in their next collective.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <utility>
#include <vector>

#include "core/comm/comm.h"

namespace rfsdp {

class StepGate {
 public:
  // comm: the ranks that step together (null or one rank: this process alone).
  // who: the start of every message ("Shampoo step").
  StepGate(Comm* comm, std::string who);

  // Records a tensor that must hold only finite values; `message` is this rank's
  // failure where it does not. CPU tensors are scanned now, device tensors in
  // agree() (one multi-tensor check per device and dtype).
  void expect_finite(const at::Tensor& t, std::string message);
  // expect_finite for a gradient: "the gradient of parameter '<name>' holds NaN or Inf".
  void check_finite(const std::string& name, const at::Tensor& grad);
  // Checks the device gradients recorded so far now (one host wait), so that
  // failed() covers them: for steps whose local work would be wasted on NaN.
  void check_device_now();
  // This rank's failure (the first one recorded is kept). invalid_argument: the
  // agreed error is a std::invalid_argument (Python's ValueError).
  void fail(const std::string& message, bool invalid_argument = false);
  // This rank could not prepare its step at all (its part of the step failed
  // before it started; ShardedOptimizer::step_refused): outranks every other
  // failure, so the agreed error names its cause, not what other ranks saw of it
  // (an owner missing this rank's rows).
  void refuse(const std::string& message, bool invalid_argument = false);
  // Runs fn; what it throws becomes this rank's failure. Returns whether it ran through.
  template <class F>
  bool guard(F&& fn) {
    try {
      fn();
      return true;
    } catch (const std::invalid_argument& e) {
      fail(e.what(), true);
    } catch (const std::exception& e) {
      fail(e.what());
    }
    return false;
  }
  // Whether this rank has recorded a failure or a non-finite CPU gradient.
  bool failed() const { return code_ != kOk; }

  // One all-reduce of every rank's code (collective); throws the agreed error.
  void agree();
  // Whether agree() found nothing on any rank (the step may change state).
  bool agreed() const { return agreed_; }

 private:
  enum Code : int64_t {
    kOk = 0, kNonFinite = 1, kError = 2, kInvalid = 3, kRefusedError = 4, kRefusedInvalid = 5
  };
  // A refusal outranks an error, an error a NaN/Inf.
  static int severity(Code c) { return c >= kRefusedError ? 3 : c >= kError ? 2 : c; }
  void record(Code code, std::string message);
  // This rank's message once agree() knows it failed (names a non-finite device gradient).
  std::string local_message(bool device_nonfinite) const;
  // The device gradients' NaN/Inf flag on `dev` (> 0: some hold one); undefined if none.
  at::Tensor device_nonfinite_flag(const at::Device& dev) const;

  Comm* comm_;
  std::string who_;
  Code code_ = kOk;
  bool agreed_ = false;
  std::string message_;
  std::vector<std::pair<std::string, at::Tensor>> on_device_;  // (message, tensor)
};

}  // namespace rfsdp
