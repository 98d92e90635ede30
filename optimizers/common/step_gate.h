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
  // agree() (one multi-tensor check per device and dtype). derived: a result
  // computed from other ranks' data (a root's Newton–Schulz of gathered rows),
  // which a non-finite gradient elsewhere explains: every other failure outranks
  // it, so the agreed error names the rank whose gradient it was.
  void expect_finite(const at::Tensor& t, std::string message, bool derived = false);
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

  // Counts every rank adds its values to in agree()'s all-reduce (no collective
  // of their own): after agree() they hold the sums over the ranks (Muon: how
  // many ranks have each parameter's gradient). Must outlive agree().
  void share_counts(std::vector<int64_t>* counts) { counts_ = counts; }

  // One all-reduce of every rank's code (collective); throws the agreed error.
  void agree();
  // Whether agree() found nothing on any rank (the step may change state).
  bool agreed() const { return agreed_; }

 private:
  // In rising severity: the agreed error names the first rank with the worst.
  // A refusal (this rank could not even prepare) outranks a bad argument, which
  // outranks a NaN/Inf gradient, which explains what other ranks computed from
  // it: an error thrown there (an eigensolver's on a gathered row), a derived
  // result that is not finite.
  enum Code : int64_t {
    kOk = 0, kDerivedNonFinite = 1, kError = 2, kNonFinite = 3, kInvalid = 4, kRefusedError = 5,
    kRefusedInvalid = 6
  };
  static int severity(Code c) { return c >= kRefusedError ? kRefusedError : c; }
  void record(Code code, std::string message);
  // This rank's message once agree() knows it failed (names a non-finite device tensor).
  std::string local_message(bool device_nonfinite) const;
  // The code the device tensors give, on `dev`: kNonFinite where a gradient (not
  // derived) holds NaN/Inf, else kDerivedNonFinite where a derived one does, else
  // kOk; undefined if none are recorded.
  at::Tensor device_code(const at::Device& dev) const;

  Comm* comm_;
  std::string who_;
  Code code_ = kOk;
  bool agreed_ = false;
  std::string message_;
  struct OnDevice {
    std::string message;
    at::Tensor t;
    bool derived;
  };
  std::vector<OnDevice> on_device_;
  std::vector<int64_t>* counts_ = nullptr;
};

}  // namespace rfsdp
