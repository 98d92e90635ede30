#include "fsdp/fsdp_unit.h"

#include <c10/core/StorageImpl.h>

#include <stdexcept>

namespace rfsdp {

namespace {

// Frees a tensor's memory but keeps its storage object, so views of it stay
// valid objects (FSDP2 does the same with storage.resize_(0)).
void release_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
}

// Gives the storage fresh memory of its full size (contents undefined).
void allocate_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  s->set_data_ptr_noswap(s->allocator()->allocate(bytes));
  s->set_nbytes(bytes);
}

bool is_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf || t == at::kDouble;
}

}  // namespace

FSDPUnit::FSDPUnit(std::shared_ptr<Comm> comm, Plan plan, MixedPrecision mp, at::Device device)
    : comm_(std::move(comm)), plan_(std::move(plan)), mp_(mp), device_(device) {
  if (!comm_) throw std::invalid_argument("FSDPUnit needs a Comm");
  if (plan_.world_size != comm_->size()) {
    throw std::invalid_argument("FSDPUnit: the plan is for world size " +
                                std::to_string(plan_.world_size) + " but the process group has " +
                                std::to_string(comm_->size()) + " ranks; plan again for this group");
  }
  validate_plan(plan_);
  if (!is_float(mp_.param_dtype) || !is_float(mp_.reduce_dtype)) {
    throw std::invalid_argument(
        "FSDPUnit: mixed precision dtypes must be floating (float32, bfloat16, float16, float64)");
  }
  S_ = plan_.shard_elems;
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device_);
  local_param_ = at::zeros({S_}, f32);
  local_grad_ = at::zeros({S_}, f32);
  global_param_ = at::empty({plan_.buffer_elems()}, f32.dtype(mp_.param_dtype));
  global_grad_ = at::empty({plan_.buffer_elems()}, f32.dtype(mp_.reduce_dtype));
  for (size_t i = 0; i < plan_.tensors.size(); ++i) {
    const TensorSpec& t = plan_.tensors[i];
    full_params_.push_back(global_param_.narrow(0, plan_.offsets[i], t.numel()).view(t.shape));
    full_grads_.push_back(global_grad_.narrow(0, plan_.offsets[i], t.numel()).view(t.shape));
  }
  release_storage(global_param_);
  release_storage(global_grad_);
}

at::Tensor FSDPUnit::local_view(const at::Tensor& slice, size_t i) const {
  const TensorSpec& t = plan_.tensors.at(i);
  const ShardRange r = shard_range(i);
  std::vector<int64_t> shape{r.row_end - r.row_begin};
  if (!t.shape.empty()) shape.insert(shape.end(), t.shape.begin() + t.row_dims, t.shape.end());
  return slice.narrow(0, r.local_offset, r.numel).view(shape);
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
  if (gather_in_flight_) {
    throw std::logic_error("FSDPUnit::unshard: an all-gather is already in flight; wait on it");
  }
  if (!param_storage_live_) {
    allocate_storage(global_param_);
    param_storage_live_ = true;
  }
  gather_in_flight_ = true;
  CommHandle h;
  if (mp_.param_dtype == at::kFloat) {
    h = comm_->all_gather_flat(global_param_, local_param_);
  } else {
    global_param_.narrow(0, comm_->rank() * S_, S_).copy_(local_param_);  // the cast
    bytes_cast_ += S_ * static_cast<int64_t>(global_param_.element_size());
    h = comm_->all_gather_flat(global_param_);
  }
  return std::move(h).then([this] { gather_in_flight_ = false; });
}

void FSDPUnit::reshard() {
  if (gather_in_flight_) {
    throw std::logic_error("FSDPUnit::reshard: the all-gather is still in flight; wait on "
                           "unshard()'s handle first");
  }
  if (param_storage_live_) release_storage(global_param_);
  param_storage_live_ = false;
}

void FSDPUnit::prepare_grads() {
  if (reduce_in_flight_) {
    throw std::logic_error("FSDPUnit::prepare_grads: a reduce-scatter is in flight; wait on it");
  }
  if (!grad_storage_live_) {
    allocate_storage(global_grad_);
    grad_storage_live_ = true;
  }
  global_grad_.zero_();
}

CommHandle FSDPUnit::reduce_grads(ReduceOp op) {
  if (!grad_storage_live_) {
    throw std::logic_error("FSDPUnit::reduce_grads: no gradients to reduce; call prepare_grads() "
                           "before backward");
  }
  if (reduce_in_flight_) {
    throw std::logic_error("FSDPUnit::reduce_grads: a reduce-scatter is already in flight");
  }
  reduce_in_flight_ = true;
  // Straight into the local gradient slice when nothing needs adding or casting;
  // otherwise into a scratch slice that is then added (in fp32) to it.
  const bool direct = mp_.reduce_dtype == at::kFloat && !has_grad_;
  at::Tensor out = direct ? local_grad_ : at::empty({S_}, global_grad_.options());
  CommHandle h = comm_->reduce_scatter_flat(global_grad_, out, op);
  return std::move(h).then([this, out, direct] {
    if (!direct) {
      local_grad_.add_(out);
      bytes_cast_ += S_ * static_cast<int64_t>(out.element_size());
    }
    has_grad_ = true;
    release_storage(global_grad_);
    grad_storage_live_ = false;
    reduce_in_flight_ = false;
  });
}

void FSDPUnit::zero_grad() {
  local_grad_.zero_();
  has_grad_ = false;
}

}  // namespace rfsdp
