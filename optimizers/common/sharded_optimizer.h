// What every optimizer over parameter shards shares: its parameters and their
// gradients (checked once, here), parameter groups with one set of options
// each, per-parameter step counts, the step gate every rank passes before a
// step changes anything, and its state by name (what a checkpoint saves).
// AdamW, AdamW8bit and Muon derive from it, Shampoo and SOAP through TiledOptimizer;
// Python binds it once.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/comm/comm.h"
#include "optimizers/common/low_precision.h"
#include "optimizers/common/param_shard.h"
#include "optimizers/common/requantize.h"
#include "optimizers/common/state_layout.h"
#include "optimizers/common/step_gate.h"

namespace rfsdp {

class ShardedOptimizer {
 public:
  // name: what construction errors call it. comm: the ranks that step together
  // (null: this process alone). check_finite: a NaN/Inf gradient on any rank
  // stops the step on every rank (StepGate). Checks every parameter (float32,
  // bfloat16 or float16, contiguous, on the CPU or a GPU, as many elements as its
  // shard's rows). States are float32 whatever the parameter's dtype.
  ShardedOptimizer(const char* name, std::vector<ParamShard> params, std::shared_ptr<Comm> comm,
                   bool check_finite);
  virtual ~ShardedOptimizer() = default;
  ShardedOptimizer(const ShardedOptimizer&) = delete;
  ShardedOptimizer& operator=(const ShardedOptimizer&) = delete;

  // What its errors call it ("AdamW", "Muon", ...).
  virtual const char* name() const = 0;
  size_t num_params() const { return params_.size(); }
  const std::vector<ParamShard>& params() const { return params_; }

  // Parameter i's tensor is now `param` (its storage was replaced: model.to(),
  // load_state_dict(assign=True), p.data = ...; or its dtype changed between
  // float32, bfloat16 and float16): the same number of elements, contiguous, on
  // the device the optimizer's state lives on (moving it elsewhere needs a new
  // optimizer, its state copied over: rfsdp.optim does that). Checked here.
  void set_param(size_t i, const at::Tensor& param);
  // How a step writes its fp32 result back to bfloat16 / float16 parameters
  // (low_precision.h); seed: the stochastic rounding's noise.
  void set_rounding(Rounding r, uint64_t seed = 0);
  Rounding rounding() const { return rounding_; }

  // The gradient parameter i steps with; undefined: it takes no step (Muon:
  // refused, every rank takes part in every step). Checked here, once.
  void set_grad(size_t i, const at::Tensor& grad);
  // All of them at once (one call per step from Python).
  void set_grads(const std::vector<at::Tensor>& grads);

  // Parameter i belongs to group group_of[i] (0 .. n-1); every group starts
  // with group 0's options. Until then, all parameters are in group 0.
  void set_groups(const std::vector<size_t>& group_of);
  size_t group_of(size_t i) const { return group_of_.at(i); }
  size_t num_groups() const { return num_groups_; }

  // One step of every parameter that has a gradient: the gradients' NaN/Inf
  // check and the optimizer's own failures are agreed by every rank before
  // anything changes (collective with a Comm).
  void step();
  // A step this rank cannot take (what went wrong before it: message): the
  // step's collectives run as the other ranks' step() runs them, stepping
  // nothing, and the agreed error is thrown on every rank (invalid_argument: a
  // std::invalid_argument). Collective.
  void step_refused(const std::string& message, bool invalid_argument);
  int64_t steps() const { return steps_; }  // calls of step() that stepped
  int64_t step_count(size_t i) const { return param_steps_.at(i); }
  const std::vector<int64_t>& step_counts() const { return param_steps_; }
  void set_step_count(size_t i, int64_t n);

  // Parameter i's state as at construction and its step count 0: what torch's
  // optimizers do when their state is cleared (the next step starts its
  // moments, momentum, factors or codes from zero). state(i) may name new
  // tensors after it. Local: every rank holding the parameter resets it alike
  // (an 8-bit scale its ranks share, a cut tile row's owner included).
  void reset_state(size_t i);

  // The tensors the step updates for parameter i, by name: what a checkpoint
  // saves and loads (in place).
  virtual std::vector<std::pair<std::string, at::Tensor>> state(size_t i) const = 0;
  // Where each of them lies in the global tensor a checkpoint keeps (one per
  // name state(i) gives, the same names on every rank, whatever rows it holds).
  virtual std::vector<StateLayout> state_layout(size_t i) const = 0;
  // Bytes of this rank's optimizer state: every tensor state() names.
  int64_t state_bytes() const;
  // Whether a checkpoint keeps parameter i's step count beside its state (false
  // for Muon's matrices, whose update does not depend on it, as torch.optim.Muon's).
  virtual bool state_has_step(size_t) const { return true; }
  // Launches of a fused multi-tensor kernel (the GPU path) so far: tests count
  // them per step.
  int64_t fused_launches() const { return fused_launches_; }

  // What the last step did (opt.metrics()). Per group: matrices orthogonalised
  // (Muon's Newton–Schulz runs), tiles preconditioned and tiles whose roots or
  // bases were refreshed (Shampoo, SOAP), counted where they ran (each once over
  // the ranks); the update's sum of squares and elements (the parameters' change,
  // p_after - p_before in float32, this rank's elements) where tracked. And the
  // step's bytes sent by this rank (its Comm's count) and wall time on the host
  // (on a GPU: until the step's last host wait, not its kernels' end).
  struct StepMetrics {
    struct Group {
      int64_t matrices = 0, tiles = 0, roots = 0;
      double update_sq = 0;
      int64_t update_numel = 0;
    };
    std::vector<Group> groups;
    int64_t step = 0;               // steps() when it was taken (0: no step yet)
    int64_t bytes_sent = 0;         // this rank's
    int64_t bytes_sent_total = 0;   // over the ranks (across_ranks; else this rank's)
    double seconds = 0;             // this rank's
    double seconds_max = 0;         // the slowest rank's (across_ranks; else this rank's)
    bool update_tracked = false;
  };
  // across_ranks: the counts, sums and bytes summed over the Comm's ranks and the
  // slowest time (one all-reduce of 6 numbers per group: collective, every rank
  // calls it); else this rank's. Reading them costs the step nothing: the counts
  // are host integers, the update's sums stay on the device until asked for.
  StepMetrics metrics(bool across_ranks) const;
  // Whether a step keeps the update's sums (a float32 copy of the stepping
  // parameters before the step, this rank's shard: memory and a pass; off by default).
  void set_track_update(bool on) { track_update_ = on; }
  bool tracks_update() const { return track_update_; }

 protected:
  // The step itself, after this rank's gradient checks went into `gate`: it
  // records its own failures there and calls gate.agree() before it changes
  // any state. Called with the parameters that have a gradient; their step
  // counts are already advanced.
  virtual void run_step(StepGate& gate, const std::vector<size_t>& stepping) = 0;
  // True where run_step checks parameter i's gradient for NaN/Inf itself (in
  // what it computes from it, while in cache), when check_finite is on.
  virtual bool checks_own_gradient(size_t) const { return false; }
  // Throws std::invalid_argument unless parameter i may step with `grad`.
  virtual void check_grad_of(size_t i, const at::Tensor& grad) const;
  // Groups became n (each new one a copy of group 0's options).
  virtual void resize_groups(size_t n) = 0;
  // reset_state's part: parameter i's state tensors as the constructor made them.
  virtual void clear_state(size_t i) = 0;
  // The parameter's name and where its shard lies, for messages.
  std::string who(size_t i) const;
  // For requantized_state: this rank's part of the saved states `names` of
  // parameter i, kept as saved (full: a checkpoint's whole state of it): its
  // rows, shaped like the live tensor, or its piece of the sequence as
  // state_layout places it, as long as the live tensor.
  NamedState saved_as_kept(size_t i, const NamedState& full,
                           const std::vector<std::string>& names) const;
  // Options of a float32 state tensor shaped like parameter i, on its device.
  at::TensorOptions state_options(size_t i) const {
    return params_.at(i).param.options().dtype(at::kFloat);
  }

  std::vector<ParamShard> params_;
  std::shared_ptr<Comm> comm_;
  bool check_finite_ = true;
  std::vector<size_t> group_of_;
  size_t num_groups_ = 1;
  std::vector<int64_t> param_steps_;
  int64_t steps_ = 0;
  int64_t fused_launches_ = 0;
  Rounding rounding_ = Rounding::kNearest;
  uint64_t rounding_seed_ = 0;
  // This step's work per group (run_step adds to it; reset when a step starts).
  std::vector<StepMetrics::Group> work_;

 private:
  bool track_update_ = false;
  at::Tensor update_sq_;  // [groups] float64 on the parameters' device: the last step's
  std::vector<int64_t> update_numel_;
  int64_t metrics_step_ = 0, bytes_sent_ = 0;
  double seconds_ = 0;
  // run_step over float32 working copies of the bfloat16 / float16 parameters
  // (and gradients) that step, written back rounded once it returned.
  void run_step_in_fp32(StepGate& gate, const std::vector<size_t>& stepping);
};

// A number as the options' errors print it: the shortest text that reads back as
// v (1e-08, 0.999, 0.9999999, inf, nan), where std::to_string printed 1e-8 as 0.000000.
std::string number_text(double v);

// The options checks' one rule: throws std::invalid_argument "<who>: <name> must be
// <rule>, got <v>" unless v is finite and ok (an inf or NaN hyperparameter passes
// comparisons such as lr >= 0, and turned the parameters to inf).
void check_option(const std::string& who, const std::string& name, double v, bool ok,
                  const std::string& rule);

// A ShardedOptimizer (or a Base that derives from it: TiledOptimizer) whose
// groups each hold one Options (the hyperparameters a scheduler may change);
// Derived checks them (check_options).
template <class Options, class Base = ShardedOptimizer>
class GroupedOptimizer : public Base {
 public:
  GroupedOptimizer(const char* name, std::vector<ParamShard> params, std::shared_ptr<Comm> comm,
                   bool check_finite, const Options& defaults)
      : Base(name, std::move(params), std::move(comm), check_finite),
        groups_{defaults} {}
  const Options& group_options(size_t g) const { return groups_.at(g); }
  void set_group_options(size_t g, const Options& o) {
    check_options(o);
    groups_.at(g) = o;
  }
  const Options& options_of(size_t i) const { return groups_[this->group_of_.at(i)]; }

 protected:
  // Throws std::invalid_argument, naming what is wrong, unless o can be stepped with.
  virtual void check_options(const Options& o) const = 0;
  void resize_groups(size_t n) override { groups_.resize(n, groups_[0]); }
  std::vector<Options> groups_;
};

}  // namespace rfsdp
