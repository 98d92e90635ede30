// How this project builds c10d process groups in C++ (torch 2.x): a
// ProcessGroup that dispatches one device type's tensors to one backend.
// Python users pass their own torch.distributed group instead.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <string>

// NCCL: only in builds against a torch with CUDA (CMake defines RFSDP_WITH_NCCL
// and USE_C10D_NCCL there).
#if defined(RFSDP_WITH_NCCL)
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace rfsdp::compat {

using Work = c10d::Work;

// A ProcessGroup that dispatches `device`'s tensors to `backend`.
inline c10::intrusive_ptr<c10d::ProcessGroup> group_of(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    c10d::ProcessGroup::BackendType type, c10::DeviceType device,
    c10::intrusive_ptr<c10d::Backend> backend) {
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  pg->setDefaultBackend(type);
  pg->setBackend(device, type, backend);
  return pg;
}

// A Gloo process group over `store` (one per rank; ranks may be threads of one process).
inline c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, const std::string& hostname = "127.0.0.1") {
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
  // Gloo's split (Comm::split) maps sub-group ranks through this list.
  for (int r = 0; r < size; ++r) opts->global_ranks_in_group.push_back(static_cast<uint64_t>(r));
  // CPU tensors only: a second device type on the same backend would be split
  // twice by splitGroup (HSDP). Python's Gloo groups take CUDA tensors too.
  return group_of(store, rank, size, c10d::ProcessGroup::BackendType::GLOO, c10::DeviceType::CPU,
                  c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts));
}

#if defined(RFSDP_WITH_NCCL)
// An NCCL process group over `store` (one process per GPU).
inline c10::intrusive_ptr<c10d::ProcessGroup> make_nccl_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout) {
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  for (int r = 0; r < size; ++r) opts->global_ranks_in_group.push_back(static_cast<uint64_t>(r));
  return group_of(store, rank, size, c10d::ProcessGroup::BackendType::NCCL, c10::DeviceType::CUDA,
                  c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts));
}

inline int cuda_device_count() { return static_cast<int>(c10::cuda::device_count()); }
inline void set_cuda_device(int d) { c10::cuda::set_device(static_cast<c10::DeviceIndex>(d)); }
#endif

// True when a c10d call failed because the backend lacks the operation (it
// then throws before starting anything, on every rank alike).
inline bool is_unsupported_op(const c10::Error& e) {
  const std::string msg = e.what_without_backtrace();
  return msg.find("does not support") != std::string::npos ||
         msg.find("no support for") != std::string::npos ||
         msg.find("not supported") != std::string::npos ||
         msg.find("not implemented") != std::string::npos;
}

}  // namespace rfsdp::compat
