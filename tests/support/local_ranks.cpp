#include "tests/support/local_ranks.h"

#include <ATen/Parallel.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>

namespace rfsdp {

std::vector<std::exception_ptr> run_local_ranks_collect(int world,
                                                        const std::function<void(Comm&)>& fn,
                                                        std::chrono::milliseconds timeout) {
  if (world < 1) throw std::invalid_argument("run_local_ranks: world must be >= 1");
  // c10d's flight recorder (torch 2.11; it keeps recent collectives for hang
  // dumps) inserts each group's status into a map it shares across groups before
  // taking its lock: ranks as threads of one process race there (a segfault now
  // and then in FlightRecorder::recordWithResetEnabled, seen under Gloo's reduce).
  // The harness turns it off before the first group reads the setting; a value
  // the caller set stays.
  static const bool recorder_off = [] { return setenv("TORCH_FR_BUFFER_SIZE", "0", 0) == 0; }();
  (void)recorder_off;
  // A fresh store per run: Gloo's rendezvous keys must not meet an earlier run's.
  auto store = c10::make_intrusive<c10d::HashStore>();
  // One intra-op thread per rank thread: a rank stands for a process with its
  // own cores, and torch 2.11's OpenMP runtime entered from several threads at
  // once corrupts the heap now and then ("malloc(): unaligned tcache chunk": 3
  // runs in 60 of 60 reduce-scatters between barriers; 0 in 80 with one thread).
  // OpenMP's thread count is per calling thread, so each rank thread sets its own.
  const int intra_op_threads = at::get_num_threads();
  // Every rank's group is built before any rank runs fn. Gloo's passive side of
  // a pair is connected when its listener hands it the socket, but its thread
  // only returns from connectFullMesh once woken: a peer whose fn makes no
  // collective (argument checks) could finish and close the socket in between,
  // and the waking rank then throws "Connection closed by peer" (seen once in
  // CI in Comm.BadArguments, on a loaded machine).
  std::mutex built_mutex;
  std::condition_variable built_cv;
  int built = 0;  // ranks whose construction returned or threw
  auto arrive_and_wait = [&] {
    std::unique_lock<std::mutex> lock(built_mutex);
    if (++built == world) built_cv.notify_all();
    built_cv.wait(lock, [&] { return built == world; });
  };
  std::vector<std::exception_ptr> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        at::set_num_threads(1);
        std::unique_ptr<Comm> comm;
        try {
          comm = std::make_unique<Comm>(compat::make_gloo_group(store, r, world, timeout), timeout);
        } catch (...) {
          arrive_and_wait();
          throw;
        }
        arrive_and_wait();
        fn(*comm);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  at::set_num_threads(intra_op_threads);
  return errors;
}

void run_local_ranks(int world, const std::function<void(Comm&)>& fn,
                     std::chrono::milliseconds timeout) {
  for (auto& e : run_local_ranks_collect(world, fn, timeout)) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace rfsdp
