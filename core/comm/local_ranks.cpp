#include "core/comm/local_ranks.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <thread>

namespace rfsdp {

std::vector<std::exception_ptr> run_local_ranks_collect(int world,
                                                        const std::function<void(Comm&)>& fn,
                                                        std::chrono::milliseconds timeout) {
  if (world < 1) throw std::invalid_argument("run_local_ranks: world must be >= 1");
  // A fresh store per run: Gloo's rendezvous keys must not meet an earlier run's.
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::exception_ptr> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        Comm comm(compat::make_gloo_group(store, r, world, timeout), timeout);
        fn(comm);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

void run_local_ranks(int world, const std::function<void(Comm&)>& fn,
                     std::chrono::milliseconds timeout) {
  for (auto& e : run_local_ranks_collect(world, fn, timeout)) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace rfsdp
