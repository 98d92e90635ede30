// Runs N ranks as threads of this process, each with its own Gloo group over
// one shared in-memory store: the harness of every multi-rank C++ test and bench.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <vector>

#include "core/comm/comm.h"

namespace rfsdp {

// Runs fn(comm) on ranks 0..world-1 concurrently and joins them. Returns each
// rank's exception (null where it returned normally).
std::vector<std::exception_ptr> run_local_ranks_collect(
    int world, const std::function<void(Comm&)>& fn,
    std::chrono::milliseconds timeout = std::chrono::seconds(60));

// Same, but rethrows the first rank's exception (after every rank has ended).
void run_local_ranks(int world, const std::function<void(Comm&)>& fn,
                     std::chrono::milliseconds timeout = std::chrono::seconds(60));

}  // namespace rfsdp
