// Comm: the collectives FSDP units and optimizers need, over a c10d::ProcessGroup
// (a user's torch.distributed group works as is: Gloo on CPU, NCCL on GPU).
//
// Where the backend lacks an operation (Gloo in torch 1.13 has no flat
// all-gather and no reduce-scatter), Comm uses a correct equivalent built from
// operations it has, and counts it in CommStats.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/comm/c10d_compat.h"

namespace rfsdp {

enum class ReduceOp { Sum, Avg };

// What Comm did, for benches and tests. Bytes are per rank.
struct CommStats {
  int64_t collectives = 0;     // operations issued (a fallback counts each piece)
  int64_t fallbacks = 0;       // operations served by a fallback instead of the backend's own
  int64_t bytes_sent = 0;      // payload this rank contributed (see each op)
  int64_t bytes_copied = 0;    // bytes copied by Comm itself, or by the backend for a fallback
};

// A handle to wait on. wait() finishes the operation (fallback copy-outs,
// averaging) and throws a clear error if a peer did not take part in time.
class CommHandle {
 public:
  CommHandle() = default;
  CommHandle(std::vector<c10::intrusive_ptr<compat::Work>> works, std::function<void()> finish,
             std::string what, std::chrono::milliseconds timeout, int rank, int size);
  CommHandle(CommHandle&& o) noexcept { *this = std::move(o); }
  CommHandle& operator=(CommHandle&& o) noexcept;
  CommHandle(const CommHandle&) = delete;
  CommHandle& operator=(const CommHandle&) = delete;
  ~CommHandle();

  void wait();
  bool done() const { return waited_; }
  // Runs `next` after this operation's own finishing steps, inside wait().
  CommHandle&& then(std::function<void()> next) &&;

 private:
  std::vector<c10::intrusive_ptr<compat::Work>> works_;
  std::function<void()> finish_;
  std::string what_;
  std::chrono::milliseconds timeout_{0};
  int rank_ = 0, size_ = 1;
  bool waited_ = true;
};

class Comm {
 public:
  static constexpr std::chrono::milliseconds kDefaultTimeout{std::chrono::minutes(5)};

  explicit Comm(c10::intrusive_ptr<c10d::ProcessGroup> pg,
                std::chrono::milliseconds timeout = kDefaultTimeout);

  // From torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
  // LOCAL_RANK): a TCPStore, then a process group. backend "auto" is NCCL when
  // this build has it and a GPU is present (the process then uses GPU
  // LOCAL_RANK), else Gloo; "gloo" and "nccl" ask for one (NCCL where absent
  // is an error saying so).
  static std::shared_ptr<Comm> from_env(std::chrono::milliseconds timeout = kDefaultTimeout,
                                        const std::string& backend = "auto");

  int rank() const { return rank_; }
  int size() const { return size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const { return pg_; }
  std::string backend_name() const;

  // buffer: m*S elements, contiguous. Rank r's slice [r*S, (r+1)*S) is its
  // input; `local` (S elements) may be given as the input instead of the slice
  // (then it is read, the slice is written). Every rank ends with all slices.
  CommHandle all_gather_flat(const at::Tensor& buffer, const at::Tensor& local = {});

  // buffer: m*S elements on every rank. out (S elements) gets the sum (or
  // mean) over ranks of slice `rank` of the buffers. The buffer is scratch
  // afterwards (a fallback may overwrite it).
  CommHandle reduce_scatter_flat(const at::Tensor& buffer, const at::Tensor& out, ReduceOp op);

  // out/in: flat tensors; out_splits[r] elements come from rank r, in_splits[r]
  // elements go to rank r (the splits agree pairwise across ranks).
  CommHandle all_to_all(const at::Tensor& out, const at::Tensor& in,
                        const std::vector<int64_t>& out_splits,
                        const std::vector<int64_t>& in_splits);

  CommHandle all_reduce(const at::Tensor& t, ReduceOp op);
  CommHandle broadcast(const at::Tensor& t, int root);
  CommHandle barrier();

  // Whether the backend has the flat all-gather and the reduce-scatter (known
  // after the first call of each; before, assumed true).
  bool native_all_gather() const { return native_all_gather_; }
  bool native_reduce_scatter() const { return native_reduce_scatter_; }

  CommStats stats() const;
  void reset_stats();

 private:
  CommHandle make_handle(std::vector<c10::intrusive_ptr<compat::Work>> works,
                         std::function<void()> finish, const std::string& what);
  void check_flat(const at::Tensor& t, const char* what) const;

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  bool native_all_gather_ = true, native_reduce_scatter_ = true;
  std::atomic<int64_t> collectives_{0}, fallbacks_{0}, bytes_sent_{0}, bytes_copied_{0};
};

}  // namespace rfsdp
