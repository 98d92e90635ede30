// FSDPUnit: one unit's parameters as ragged shards of flat buffers (the DBuffer).
//
// Sharded state: the local slice of S fp32 elements (master weights) and of S
// fp32 gradient elements, laid out by the unit's Plan. Unsharded state: a
// global buffer of m*S elements in the compute dtype whose views are the full
// parameters, filled by an in-place all-gather; and a global gradient buffer in
// the reduce dtype whose views receive the full gradients, reduce-scattered
// into the local gradient slice. Releasing a global buffer keeps its views
// valid objects (the storage is emptied, then refilled on the next gather).
//
// On a GPU (device CUDA): gathers run on the device's gather stream, reduce-
// scatters on its reduce stream, both ordered after the current (compute)
// stream's work so far; their handles' wait() orders the current stream after
// them (DeviceStreams). The host does not block on NCCL.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "core/comm/comm.h"
#include "core/ragged/plan.h"
#include "core/ragged/step_model.h"
#include "core/ragged/param_shard.h"
#include "core/ragged/tensor_shard.h"
#include "fsdp/comm_policy.h"
#include "fsdp/device_streams.h"
#include "fsdp/gathered_buffer.h"
#include "fsdp/quantized_gather.h"

namespace rfsdp {

struct MixedPrecision {
  at::ScalarType param_dtype = at::kFloat;   // dtype of the gathered (compute) parameters
  at::ScalarType reduce_dtype = at::kFloat;  // dtype gradients are reduced in
};

class FSDPUnit {
 public:
  // The plan's world size must equal the comm's; its tensors are this unit's
  // parameters, in order. device: where every buffer lives (CPU, or a GPU).
  // Collective: the ranks first agree that they build the same unit (names,
  // shapes, granules, element sizes, dtypes: one all-reduce of a hash), else
  // every rank throws naming the first difference; agree = false skips that for
  // callers that agreed on more already (rfsdp.fully_shard).
  FSDPUnit(std::shared_ptr<Comm> comm, Plan plan, MixedPrecision mp = {},
           at::Device device = at::kCPU, bool agree = true);
  // HSDP: sharded over `shard` (the plan's world size), replicated over
  // `replicate` (the ranks holding the same shard, one per replica; null or one
  // rank: plain FSDP). Gradients reduce-scatter inside the shard group, then
  // all-reduce across the replica group; parameters gather inside the shard group.
  FSDPUnit(std::shared_ptr<Comm> shard, std::shared_ptr<Comm> replicate, Plan plan,
           MixedPrecision mp = {}, at::Device device = at::kCPU, bool agree = true);
  // With a communication policy (fsdp/comm_policy.h): the weights' gathers as
  // block codes (the plan must keep the blocks whole on ranks: an error naming
  // the first tensor it cuts, otherwise), the gradients in bfloat16 summed in fp32.
  FSDPUnit(std::shared_ptr<Comm> shard, std::shared_ptr<Comm> replicate, Plan plan,
           MixedPrecision mp, CommPolicy comm_policy, at::Device device = at::kCPU,
           bool agree = true);
  // What the ranks agree on at construction: one line per tensor, then the
  // dtypes and device.
  static std::vector<std::string> describe(const Plan& plan, const MixedPrecision& mp,
                                           const at::Device& device,
                                           const CommPolicy& comm_policy = {});
  FSDPUnit(const FSDPUnit&) = delete;
  FSDPUnit& operator=(const FSDPUnit&) = delete;

  const Plan& plan() const { return plan_; }
  // The shard group (gathers, reduce-scatters, clipping norms, Muon's roots).
  Comm& comm() { return *comm_; }
  // The replica group, or null (plain FSDP).
  const std::shared_ptr<Comm>& replicate_comm() const { return replicate_; }
  // Ranks whose gradients each local gradient slice sums: shard x replica group sizes.
  int data_parallel_size() const;
  size_t num_params() const { return plan_.tensors.size(); }
  const MixedPrecision& mixed_precision() const { return mp_; }
  const CommPolicy& comm_policy() const { return policy_; }
  // Bytes that leave this rank in one gather of the parameters and in one reduce
  // of the gradients, under the unit's dtypes and communication policy (its
  // slice to each of the m-1 others: ring and direct algorithms alike; HSDP's
  // replica exchange of the slice on top).
  int64_t gather_bytes_sent() const;
  int64_t reduce_bytes_sent() const;
  // What travels in this unit's collectives (core/ragged/step_model.h's formulas).
  WireFormat wire_format() const;
  // Those bytes summed over the gathers and reduces this unit ran (zeroed by reset).
  int64_t bytes_sent() const { return bytes_sent_; }
  void reset_bytes_sent() { bytes_sent_ = 0; }
  at::Device device() const { return device_; }

  // Each rank keeps its rows of the full initial parameters (identical on
  // every rank; plan order; any floating dtype). Clears the gradients.
  void shard(const std::vector<at::Tensor>& full_params);

  // All-gathers the parameters into the global buffer (allocated if released).
  // The one cast to the compute dtype happens on the local slice, before the gather.
  CommHandle unshard();
  // Releases the global parameter buffer; full_param views stay valid objects.
  // On a GPU the gather stream first waits for the compute stream's reads
  // enqueued so far (DeviceStreams::release_after_reads).
  void reshard();
  bool unsharded() const { return params_.live(); }
  // Bytes of the global parameter and gradient buffers allocated now.
  int64_t gathered_bytes() const { return params_.bytes() + grads_.bytes(); }

  // Allocates and zeroes the global gradient buffer: backward accumulates into
  // full_grad views (set them as the parameters' .grad). keep: a buffer still
  // holding gradients of backwards not reduced (gradient sync off, accumulation
  // unsharded) is kept as it is, so this backward adds to them.
  void prepare_grads(bool keep = false);
  // The global gradient buffer holds gradients not yet reduced (or being reduced).
  bool grads_unsharded() const { return grads_.live(); }
  // Reduce-scatters the global gradients into the local gradient slice (and
  // all-reduces them across replicas), adding to what it holds (gradient
  // accumulation), then releases the global buffer. Avg divides by every rank's
  // count, data_parallel_size(), once.
  CommHandle reduce_grads(ReduceOp op = ReduceOp::Avg);
  void zero_grad();

  // Full-shape views into the global buffers (usable while allocated).
  const at::Tensor& full_param(size_t i) const { return params_.view(i); }
  const at::Tensor& full_grad(size_t i) const { return grads_.view(i); }
  // This rank's rows [row_begin, row_end) of tensor i, shaped (rows, *rest): views
  // of the fp32 local slices (possibly 0 rows).
  at::Tensor local_param(size_t i) const { return local_view(local_param_, i); }
  at::Tensor local_grad(size_t i) const { return local_view(local_grad_, i); }
  ShardRange shard_range(size_t i) const { return plan_.shard(i, comm_->rank()); }
  // Tensor i's piece on this rank, with every rank's rows: what optimizers,
  // clipping and checkpoints read.
  TensorShard tensor_shard(size_t i) const { return TensorShard::of_plan(plan_, i, comm_->rank()); }

  const at::Tensor& local_param_slice() const { return local_param_; }
  const at::Tensor& local_grad_slice() const { return local_grad_; }
  // Bytes this unit converted between dtypes on its local slices (the mixed-
  // precision cast before the gather, and gradient reduce-dtype accumulation).
  int64_t bytes_cast() const { return bytes_cast_; }

 private:
  at::Tensor local_view(const at::Tensor& slice, size_t i) const;
  // HSDP: throws (on every member) unless the replicas hold equal shards.
  void check_replicas() const;
  // After the reduce: adds a scratch slice to the local gradients, frees the buffer.
  void finish_reduce(const at::Tensor& out, bool direct);

  std::shared_ptr<Comm> comm_, replicate_;
  Plan plan_;
  MixedPrecision mp_;
  CommPolicy policy_;
  std::unique_ptr<QuantizedGather> quantized_;  // weights as codes (policy_), or null
  at::Device device_;
  DeviceStreams* streams_ = nullptr;  // GPU only
  int64_t S_;
  at::Tensor local_param_, local_grad_;  // fp32 [S]
  GatheredBuffer params_, grads_;         // [m*S] in the compute / reduce dtype
  bool has_grad_ = false;  // the local gradient slice holds reduced gradients
  int64_t bytes_cast_ = 0;
  int64_t bytes_sent_ = 0;
};

// The local shards of a unit's parameters (views of its local slices), each
// knowing every rank's rows (the unit's plan): what the optimizers take.
std::vector<ParamShard> param_shards(const FSDPUnit& unit);

}  // namespace rfsdp
