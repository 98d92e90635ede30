#include "fsdp/gathered_buffer.h"

#include <c10/core/StorageImpl.h>

#include <stdexcept>

namespace rfsdp {

GatheredBuffer::GatheredBuffer(const Plan& plan, at::TensorOptions options, std::string what)
    : what_(std::move(what)) {
  flat_ = at::empty({plan.buffer_elems()}, options);
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const TensorSpec& t = plan.tensors[i];
    views_.push_back(flat_.narrow(0, plan.global_offset(i), t.numel()).view(t.shape));
  }
  live_ = true;
  release();  // dropped: freed
}

void GatheredBuffer::allocate() {
  if (live_) return;
  c10::StorageImpl* s = flat_.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(flat_.numel()) * flat_.element_size();
  s->set_data_ptr_noswap(s->allocator()->allocate(bytes));
  s->set_nbytes(bytes);
  live_ = true;
}

at::DataPtr GatheredBuffer::release() {
  if (in_flight_) {
    throw std::logic_error("the " + what_ + " buffer has a collective in flight; wait on it first");
  }
  if (!live_) return at::DataPtr(nullptr, flat_.device());
  // Takes the memory but keeps the storage object, so views stay valid objects
  // (FSDP2 does the same with storage.resize_(0)).
  c10::StorageImpl* s = flat_.storage().unsafeGetStorageImpl();
  at::DataPtr memory = s->set_data_ptr(at::DataPtr(nullptr, flat_.device()));
  s->set_nbytes(0);
  live_ = false;
  return memory;
}

void GatheredBuffer::begin(const char* op) {
  if (in_flight_) {
    throw std::logic_error(std::string(op) + ": a collective on the " + what_ +
                           " buffer is already in flight; wait on it");
  }
  in_flight_ = true;
}

}  // namespace rfsdp
