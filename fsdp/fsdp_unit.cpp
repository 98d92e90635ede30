#include "fsdp/fsdp_unit.h"

#include <c10/core/StreamGuard.h>

#include <optional>
#include <stdexcept>

#include "core/comm/agree.h"
#include "fsdp/fp32_sum_reduce.h"

namespace rfsdp {

namespace {

bool is_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf || t == at::kDouble;
}

}  // namespace

FSDPUnit::FSDPUnit(std::shared_ptr<Comm> comm, Plan plan, MixedPrecision mp, at::Device device,
                   bool agree)
    : FSDPUnit(std::move(comm), nullptr, std::move(plan), mp, device, agree) {}

std::vector<std::string> FSDPUnit::describe(const Plan& plan, const MixedPrecision& mp,
                                            const at::Device& device,
                                            const CommPolicy& comm_policy) {
  std::vector<std::string> lines;
  for (const TensorSpec& t : plan.tensors) {
    lines.push_back("tensor '" + t.name + "' shape " + shape_to_string(t.shape) + " granule " +
                    std::to_string(t.granule_rows) + " row_dims " + std::to_string(t.row_dims) +
                    " element bytes " + std::to_string(t.elem_bytes));
  }
  lines.push_back("planned for " + std::to_string(plan.world_size) + " ranks");
  lines.push_back(std::string("param dtype ") + c10::toString(mp.param_dtype) + ", reduce dtype " +
                  c10::toString(mp.reduce_dtype) + ", device " +
                  c10::DeviceTypeName(device.type(), /*lower_case=*/true));
  lines.push_back("communication: " + comm_policy.describe());
  return lines;
}

FSDPUnit::FSDPUnit(std::shared_ptr<Comm> comm, std::shared_ptr<Comm> replicate, Plan plan,
                   MixedPrecision mp, at::Device device, bool agree)
    : FSDPUnit(std::move(comm), std::move(replicate), std::move(plan), mp, CommPolicy{}, device,
               agree) {}

FSDPUnit::FSDPUnit(std::shared_ptr<Comm> comm, std::shared_ptr<Comm> replicate, Plan plan,
                   MixedPrecision mp, CommPolicy comm_policy, at::Device device, bool agree)
    : comm_(std::move(comm)), replicate_(std::move(replicate)), plan_(std::move(plan)), mp_(mp),
      policy_(comm_policy), device_(device) {
  if (!comm_) throw std::invalid_argument("FSDPUnit needs a Comm");
  // Before any other collective: ranks building different units would otherwise
  // meet in collectives of different sizes (Gloo aborts the process there).
  if (agree) agree_lines(*comm_, describe(plan_, mp_, device_, policy_), "FSDPUnit");
  if (!device_.is_cpu() && !device_.is_cuda()) {
    throw std::invalid_argument("FSDPUnit: parameters on " + device_.str() +
                                " are not supported; use the CPU or a CUDA device");
  }
  for (const Comm* c : {comm_.get(), replicate_.get()}) {
    if (c && device_.is_cpu() && !c->control_device().is_cpu()) {
      throw std::invalid_argument("FSDPUnit: the process group's backend is " + c->backend_name() +
                                  ", which takes CUDA tensors only, but the unit is on the CPU; "
                                  "move the module to its GPU first, or use a Gloo group");
    }
  }
  if (replicate_ && replicate_->size() == 1) replicate_ = nullptr;  // one replica: plain FSDP
  if (plan_.world_size != comm_->size()) {
    throw std::invalid_argument("FSDPUnit: the plan is for world size " +
                                std::to_string(plan_.world_size) + " but the process group has " +
                                std::to_string(comm_->size()) + " ranks; plan again for this group");
  }
  validate_plan(plan_);
  if (replicate_) check_replicas();
  if (!is_float(mp_.param_dtype) || !is_float(mp_.reduce_dtype)) {
    throw std::invalid_argument(
        "FSDPUnit: mixed precision dtypes must be floating (float32, bfloat16, float16, float64)");
  }
  S_ = plan_.shard_elems;
  if (!device_.is_cpu()) streams_ = &DeviceStreams::of(device_);
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device_);
  local_param_ = at::zeros({S_}, f32);
  local_grad_ = at::zeros({S_}, f32);
  params_ = GatheredBuffer(plan_, f32.dtype(mp_.param_dtype), "parameter");
  if (policy_.quantised_weights()) {
    quantized_ = std::make_unique<QuantizedGather>(plan_, comm_->rank(), policy_, device_);
  }
  grads_ = GatheredBuffer(plan_, f32.dtype(mp_.reduce_dtype), "gradient");
}

at::Tensor FSDPUnit::local_view(const at::Tensor& slice, size_t i) const {
  const TensorSpec& t = plan_.tensors.at(i);
  const ShardRange r = shard_range(i);
  std::vector<int64_t> shape{r.row_end - r.row_begin};
  if (!t.shape.empty()) shape.insert(shape.end(), t.shape.begin() + t.row_dims, t.shape.end());
  return slice.narrow(0, r.local_offset, r.numel).view(shape);
}

void FSDPUnit::check_replicas() const {
  // Replicas must hold equal shards: the same shard rank, group size and plan. One
  // all-reduce of (x, x^2): every member's x is equal iff r * sum(x^2) == sum(x)^2.
  const double x[3] = {static_cast<double>(comm_->rank()), static_cast<double>(comm_->size()),
                       static_cast<double>(plan_.shard_elems)};
  at::Tensor v = at::empty({6}, at::TensorOptions().dtype(at::kDouble));
  for (int k = 0; k < 3; ++k) {
    v[k] = x[k];
    v[3 + k] = x[k] * x[k];
  }
  v = v.to(replicate_->control_device());
  replicate_->all_reduce(v, ReduceOp::Sum).wait();
  const double r = replicate_->size();
  const at::Tensor c = v.cpu();
  const double* s = c.data_ptr<double>();
  for (int k = 0; k < 3; ++k) {
    if (r * s[3 + k] != s[k] * s[k]) {
      static const char* what[3] = {"shard ranks", "shard group sizes", "plans (S)"};
      throw std::invalid_argument(
          std::string("FSDPUnit: the replica group's ranks have different ") + what[k] +
          "; each replica group must take one rank of every shard group, at the same position, "
          "planned alike (build both groups from one 2-D mesh: hybrid_groups, or FSDP2's "
          "DeviceMesh (replicate, shard))");
    }
  }
}

int FSDPUnit::data_parallel_size() const {
  return comm_->size() * (replicate_ ? replicate_->size() : 1);
}

void FSDPUnit::shard(const std::vector<at::Tensor>& full) {
  if (full.size() != plan_.tensors.size()) {
    throw std::invalid_argument("FSDPUnit::shard: got " + std::to_string(full.size()) +
                                " tensors for a unit of " + std::to_string(plan_.tensors.size()));
  }
  at::NoGradGuard no_grad;
  local_param_.zero_();
  for (size_t i = 0; i < full.size(); ++i) {
    const TensorSpec& t = plan_.tensors[i];
    if (full[i].sizes().vec() != t.shape) {
      throw std::invalid_argument("FSDPUnit::shard: tensor '" + t.name + "' has shape " +
                                  c10::str(full[i].sizes()) + ", the plan says " +
                                  shape_to_string(t.shape));
    }
    if (!is_float(full[i].scalar_type())) {
      throw std::invalid_argument("FSDPUnit::shard: tensor '" + t.name +
                                  "' is not floating point (" +
                                  std::string(c10::toString(full[i].scalar_type())) + ")");
    }
    const ShardRange r = shard_range(i);
    if (r.empty()) continue;
    local_param_.narrow(0, r.local_offset, r.numel)
        .copy_(full[i].reshape(-1).narrow(0, r.row_begin * t.row_elems(), r.numel));
  }
  zero_grad();
}

CommHandle FSDPUnit::unshard() {
  params_.begin("FSDPUnit::unshard");
  try {
    // GPU: on the gather stream, after the compute stream's work so far (the
    // optimizer wrote the local slice); the buffer is allocated on the gather stream.
    std::optional<c10::StreamGuard> on_gather;
    if (streams_) {
      streams_->wait_for_current(streams_->gather_stream());
      on_gather.emplace(streams_->gather_stream());
    }
    params_.allocate();
    bytes_sent_ += gather_bytes_sent();
    if (quantized_) {  // codes and scales travel; decoded into the compute buffer
      CommHandle h = quantized_->gather(*comm_, local_param_);
      if (streams_) {
        h.wait();
        quantized_->decode(params_.flat());
        return CommHandle::after_event(streams_->record(streams_->gather_stream()),
                                       "FSDPUnit::unshard")
            .then([this] { params_.end(); });
      }
      return std::move(h).then([this] {
        quantized_->decode(params_.flat());
        params_.end();
      });
    }
    std::vector<CommHandle> hs;
    for (size_t b = 0; b < plan_.num_buffers(); ++b) {  // one in-place gather per buffer
      const int64_t Sb = plan_.buffer_shard(b);
      at::Tensor global = params_.flat().narrow(0, plan_.buffer_global_begin(b),
                                                plan_.world_size * Sb);
      at::Tensor local = local_param_.narrow(0, plan_.buffer_local_begin(b), Sb);
      if (mp_.param_dtype == at::kFloat) {
        hs.push_back(comm_->all_gather_flat(global, local));
      } else {
        global.narrow(0, comm_->rank() * Sb, Sb).copy_(local);  // the cast
        hs.push_back(comm_->all_gather_flat(global));
      }
    }
    if (mp_.param_dtype != at::kFloat) {
      bytes_cast_ += S_ * static_cast<int64_t>(params_.flat().element_size());
    }
    if (streams_) {
      CommHandle::all(std::move(hs)).wait();  // the gather stream waits for NCCL's
      return CommHandle::after_event(streams_->record(streams_->gather_stream()),
                                     "FSDPUnit::unshard")
          .then([this] { params_.end(); });
    }
    return CommHandle::all(std::move(hs)).then([this] { params_.end(); });
  } catch (...) {
    params_.end();
    throw;
  }
}

void FSDPUnit::reshard() {
  at::DataPtr memory = params_.release();
  if (streams_) streams_->release_after_reads(std::move(memory));
}

void FSDPUnit::prepare_grads(bool keep) {
  if (grads_.in_flight()) {
    throw std::logic_error("FSDPUnit::prepare_grads: a reduce-scatter is in flight; wait on it");
  }
  if (keep && grads_.live()) {
    return;
  }
  grads_.allocate();
  grads_.flat().zero_();
}

CommHandle FSDPUnit::reduce_grads(ReduceOp op) {
  if (!grads_.live()) {
    throw std::logic_error("FSDPUnit::reduce_grads: no gradients to reduce; call prepare_grads() "
                           "before backward");
  }
  grads_.begin("FSDPUnit::reduce_grads");
  bytes_sent_ += reduce_bytes_sent();
  // Straight into the local gradient slice when nothing needs adding or casting;
  // otherwise into a scratch slice that is then added (in fp32) to it. Gradients
  // in a narrow wire dtype are summed in fp32: their scratch is fp32.
  const std::optional<at::ScalarType> wire = policy_.gradients;
  const bool direct = (mp_.reduce_dtype == at::kFloat || wire) && !has_grad_;
  try {
    at::Tensor out = direct ? local_grad_
                            : at::empty({S_}, grads_.flat().options().dtype(wire ? at::kFloat
                                                                                 : mp_.reduce_dtype));
    // One reduce-scatter per buffer. HSDP: sums inside the shard group, then across
    // replicas (on the slice alone, before anything accumulated is added), then one
    // division by every rank's count.
    auto scatter = [&](ReduceOp o) {
      std::vector<CommHandle> hs;
      for (size_t b = 0; b < plan_.num_buffers(); ++b) {
        const int64_t Sb = plan_.buffer_shard(b);
        const at::Tensor global =
            grads_.flat().narrow(0, plan_.buffer_global_begin(b), plan_.world_size * Sb);
        const at::Tensor mine = out.narrow(0, plan_.buffer_local_begin(b), Sb);
        if (!wire) {
          hs.push_back(comm_->reduce_scatter_flat(global, mine, o));
          continue;
        }
        hs.push_back(reduce_scatter_summed_in_fp32(*comm_, global, mine, *wire).then([mine, o, this] {
          if (o == ReduceOp::Avg) mine.div_(static_cast<double>(comm_->size()));
        }));
      }
      return CommHandle::all(std::move(hs));
    };
    auto across_replicas = [this, out, op, wire] {
      if (wire) {
        all_reduce_summed_in_fp32(*replicate_, out, *wire).wait();
      } else {
        replicate_->all_reduce(out, ReduceOp::Sum).wait();
      }
      if (op == ReduceOp::Avg) out.div_(static_cast<double>(data_parallel_size()));
    };
    if (streams_) {
      // GPU: every collective on the reduce stream, after backward's writes to
      // the gradients; the scratch slice was allocated on the compute stream,
      // which reads it (and frees the gradient buffer) after the handle's wait.
      streams_->wait_for_current(streams_->reduce_stream());
      {
        c10::StreamGuard on_reduce(streams_->reduce_stream());
        scatter(replicate_ ? ReduceOp::Sum : op).wait();
        if (replicate_) across_replicas();
      }
      return CommHandle::after_event(streams_->record(streams_->reduce_stream()),
                                     "FSDPUnit::reduce_grads")
          .then([this, out, direct] { finish_reduce(out, direct); });
    }
    if (!replicate_) {
      return scatter(op).then([this, out, direct] { finish_reduce(out, direct); });
    }
    return scatter(ReduceOp::Sum).then([this, out, direct, across_replicas] {
      across_replicas();
      finish_reduce(out, direct);
    });
  } catch (...) {
    grads_.end();
    throw;
  }
}

void FSDPUnit::finish_reduce(const at::Tensor& out, bool direct) {
  if (!direct) {
    local_grad_.add_(out);
    bytes_cast_ += S_ * static_cast<int64_t>(out.element_size());
  }
  has_grad_ = true;
  grads_.end();
  grads_.release();
}

void FSDPUnit::zero_grad() {
  local_grad_.zero_();
  has_grad_ = false;
}

WireFormat FSDPUnit::wire_format() const {
  WireFormat w;
  w.weight_bytes = static_cast<int64_t>(c10::elementSize(mp_.param_dtype));
  if (quantized_) w.code_block = policy_.weight_block;
  w.grad_bytes = static_cast<int64_t>(c10::elementSize(policy_.gradients.value_or(mp_.reduce_dtype)));
  // replicas sum fp32 slices, or the policy's narrow ones (fsdp/fp32_sum_reduce.h)
  w.replica_bytes = policy_.gradients ? w.grad_bytes : 4;
  return w;
}

int64_t FSDPUnit::gather_bytes_sent() const { return gather_bytes(plan_, wire_format()); }

int64_t FSDPUnit::reduce_bytes_sent() const {
  return reduce_bytes(plan_, wire_format(), replicate_ ? replicate_->size() : 1);
}

std::vector<ParamShard> param_shards(const FSDPUnit& unit) {
  std::vector<ParamShard> out;
  for (size_t i = 0; i < unit.num_params(); ++i) {
    out.emplace_back(unit.tensor_shard(i), unit.local_param(i), unit.local_grad(i));
  }
  return out;
}

}  // namespace rfsdp
