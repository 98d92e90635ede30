// Comm::from_env: a process's start-up from torchrun's environment (a TCPStore,
// then a Gloo or NCCL group), apart from the collectives themselves.
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <unistd.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "core/comm/comm.h"

namespace rfsdp {

namespace {

std::string env_or_throw(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') {
    throw std::runtime_error(std::string(name) +
                             " is not set: launch with torchrun (it sets RANK, WORLD_SIZE, "
                             "MASTER_ADDR, MASTER_PORT) or build Comm from a ProcessGroup");
  }
  return v;
}

int env_int(const char* name) {
  const std::string v = env_or_throw(name);
  char* end = nullptr;
  const long x = std::strtol(v.c_str(), &end, 10);
  if (*end != '\0' || x < 0) {
    throw std::runtime_error(std::string(name) + "='" + v + "' is not a non-negative integer");
  }
  return static_cast<int>(x);
}

}  // namespace

std::shared_ptr<Comm> Comm::from_env(std::chrono::milliseconds timeout,
                                     const std::string& backend) {
  if (backend != "auto" && backend != "gloo" && backend != "nccl") {
    throw std::invalid_argument("Comm::from_env: backend must be \"auto\", \"gloo\" or \"nccl\", "
                                "got \"" + backend + "\"");
  }
#if defined(RFSDP_WITH_NCCL)
  const bool use_nccl = backend == "nccl" || (backend == "auto" && compat::cuda_device_count() > 0);
#else
  if (backend == "nccl") {
    throw std::invalid_argument("Comm::from_env: this build has no NCCL (it was built against a "
                                "torch without CUDA); use \"gloo\"");
  }
  const bool use_nccl = false;
#endif
  const int rank = env_int("RANK"), size = env_int("WORLD_SIZE");
  if (size < 1 || rank >= size) {
    throw std::runtime_error("RANK=" + std::to_string(rank) + " is out of range for WORLD_SIZE=" +
                             std::to_string(size));
  }
  const std::string addr = env_or_throw("MASTER_ADDR");
  const int port = env_int("MASTER_PORT");
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(port);
  opts.isServer = rank == 0;
  opts.numWorkers = size;
  opts.timeout = timeout;
  auto store = c10::make_intrusive<c10d::TCPStore>(addr, opts);
#if defined(RFSDP_WITH_NCCL)
  if (use_nccl) {
    const int devices = compat::cuda_device_count();
    if (devices == 0) throw std::runtime_error("Comm::from_env: NCCL asked for, but no GPU is visible");
    const char* lr = std::getenv("LOCAL_RANK");
    compat::set_cuda_device((lr ? std::atoi(lr) : rank) % devices);
    return std::make_shared<Comm>(compat::make_nccl_group(store, rank, size, timeout), timeout);
  }
#endif
  (void)use_nccl;
  // Gloo connects to the address peers see: loopback for a one-machine job.
  std::string host = "127.0.0.1";
  if (addr != "localhost" && addr.rfind("127.", 0) != 0) {
    char name[256] = {0};
    gethostname(name, sizeof(name) - 1);
    host = name;
  }
  return std::make_shared<Comm>(compat::make_gloo_group(store, rank, size, timeout, host), timeout);
}

}  // namespace rfsdp
