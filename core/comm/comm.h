// Comm: the collectives FSDP units and optimizers need, over a c10d::ProcessGroup
// (a user's torch.distributed group works as is: Gloo on CPU, NCCL on GPU).
//
// The two flat collectives FSDP lives on run as the backend's own operation,
// as one in-place operation per rank (broadcasts for the gather, reduces
// rooted at each slice's owner for the reduce-scatter), or (the reduce-scatter)
// as one all-to-all summed by each slice's owner, whichever is faster on that
// backend (FlatAlgorithm); CommStats counts which ran.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/comm/c10d_compat.h"

namespace rfsdp {

// Max: all_reduce only (agreeing a block's absmax across the ranks that share it).
enum class ReduceOp { Sum, Avg, Max };

// How all_gather_flat / reduce_scatter_flat run.
//  Native:  the backend's all_gather_into_tensor / reduce_scatter_tensor. NCCL
//           runs both in place. Gloo (torch 2.x) stages both: its all-gather
//           gathers into a scratch buffer and copies every slice out; its
//           reduce-scatter clones the whole buffer and all-reduces it (twice a
//           reduce-scatter's traffic), then copies the own slice out.
//  PerRank: m in-place broadcasts (rank r's slice from rank r), or m in-place
//           reduces (slice r rooted at rank r, then the own slice copied out).
//  AllToAll (reduce-scatter only): one all-to-all (slice r of every rank to
//           rank r), the m pieces summed by their owner in rank order. One
//           round whatever m, where PerRank's m reduces take m rounds and Gloo's
//           native all-reduce 2(m-1) ring steps of the whole buffer.
//  Auto:    the fastest for the backend, the group's size (and for Gloo's
//           reduce-scatter beyond 2 ranks, the slice's bytes), as
//           bench_collectives measured it (see Comm::resolve).
enum class FlatAlgorithm { Auto, Native, PerRank, AllToAll };
const char* to_string(FlatAlgorithm a);

// What Comm did, for benches and tests. Bytes are per rank.
struct CommStats {
  int64_t collectives = 0;     // operations issued (a per-rank algorithm counts each piece)
  int64_t fallbacks = 0;       // flat collectives run per rank instead of natively
  int64_t gathers_native = 0, gathers_per_rank = 0;                  // all_gather_flat calls
  int64_t reduce_scatters_native = 0, reduce_scatters_per_rank = 0;  // reduce_scatter_flat calls
  int64_t reduce_scatters_all_to_all = 0;
  int64_t bytes_sent = 0;      // payload this rank contributed (see each op)
  int64_t bytes_copied = 0;    // bytes copied by Comm, or by the backend's staging (Gloo)
};

// A handle to wait on. wait() finishes the operation (fallback copy-outs,
// averaging) and throws a clear error if a peer did not take part in time.
//
// On CPU tensors wait() returns when the operation is done. On GPU tensors it
// orders the *current stream* after the operation (NCCL: a stream dependency,
// the host does not block; the backend's watchdog owns timeouts there): work
// enqueued on the current stream after wait() sees the result, and a host read
// of the result needs a synchronisation first, as with any CUDA result.
class CommHandle {
 public:
  CommHandle() = default;
  // on_device: the works' tensors live on a GPU (wait as above).
  CommHandle(std::vector<c10::intrusive_ptr<compat::Work>> works, std::function<void()> finish,
             std::string what, std::chrono::milliseconds timeout, int rank, int size,
             bool on_device = false);
  // Work already enqueued on some stream, complete on the device once `ready`
  // fires: wait() makes the current stream wait on the event, then finishes.
  static CommHandle after_event(std::shared_ptr<c10::Event> ready, std::string what);
  CommHandle(CommHandle&& o) noexcept { *this = std::move(o); }
  CommHandle& operator=(CommHandle&& o) noexcept;
  CommHandle(const CommHandle&) = delete;
  CommHandle& operator=(const CommHandle&) = delete;
  ~CommHandle();

  void wait();
  bool waited() const { return waited_; }
  // Runs `next` after this operation's own finishing steps, inside wait(): on a
  // GPU after the current stream was ordered after the operation, so what `next`
  // enqueues on the current stream runs after it.
  CommHandle&& then(std::function<void()> next) &&;
  // One handle for several operations, waited in order (one given: itself).
  static CommHandle all(std::vector<CommHandle> handles);

 private:
  std::vector<c10::intrusive_ptr<compat::Work>> works_;
  std::shared_ptr<c10::Event> ready_;
  std::function<void()> finish_;
  std::string what_;
  std::chrono::milliseconds timeout_{0};
  int rank_ = 0, size_ = 1;
  bool waited_ = true, on_device_ = false;
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
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const { return pg_; }
  const std::string& backend_name() const { return backend_name_; }
  // Where this group's small control tensors (flags, norms, tables) must live:
  // the current GPU for an NCCL-only group (NCCL takes no CPU tensors), else the
  // CPU (Gloo takes both).
  at::Device control_device() const;

  // A Comm over the sub-group of `ranks` of this group (ascending, this rank
  // among them), made by the backend's split (c10d splitGroup): every rank of
  // `ranks` calls it with the same ranks and name, in the same order relative to
  // its other splits and collectives. Ranks outside `ranks` do not call it.
  std::shared_ptr<Comm> split(const std::vector<int>& ranks, const std::string& name) const;

  // Drops this Comm's reference to the process group (later collectives are an
  // error saying so). A Gloo group's worker threads end when its last reference
  // goes: rfsdp's Python package closes its Comms at interpreter exit, before
  // Python stops serving those threads the GIL they may need.
  void close();
  bool closed() const { return !pg_; }

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

  // The algorithms the flat collectives use (Auto resolved for this backend;
  // Gloo's reduce-scatter beyond 2 ranks stays Auto: chosen per call by the
  // slice's size). Every rank of a group must choose the same.
  void set_flat_algorithms(FlatAlgorithm gather, FlatAlgorithm reduce_scatter);
  FlatAlgorithm gather_algorithm() const { return gather_algo_; }
  FlatAlgorithm reduce_scatter_algorithm() const { return reduce_scatter_algo_; }

  CommStats stats() const;
  void reset_stats();
  // Whether every collective first checks in with the other ranks (Gloo, unless
  // RFSDP_CHECK_COLLECTIVES=0): one small all-gather of (its place in the
  // group's sequence of collectives, the operation, its elements, its dtype), so
  // ranks that would meet in different collectives (one rank skipped part of a
  // step: caught an exception and went on; or runs other code) all raise an
  // error naming what each rank was doing, where Gloo would abort the processes
  // ("Received data size doesn't match"). NCCL is left alone: its mismatches
  // hang until its watchdog, and a host-side check would stall its streams.
  bool checks_collectives() const { return checked_; }
  void set_checks_collectives(bool on) { checked_ = on && size_ > 1; }

 private:
  CommHandle make_handle(std::vector<c10::intrusive_ptr<compat::Work>> works,
                         std::function<void()> finish, const std::string& what,
                         const at::Tensor& on);
  void check_flat(const at::Tensor& t, const char* what) const;
  FlatAlgorithm resolve(FlatAlgorithm a, bool gather) const;
  // The reduce-scatter's algorithm for one call when its choice is Auto
  // (Gloo beyond 2 ranks): by the bytes of a rank's slice.
  FlatAlgorithm reduce_scatter_auto(int64_t slice_bytes) const;
  c10d::ProcessGroup& group() const;
  CommHandle gather_per_rank(const at::Tensor& buffer, const at::Tensor& slice,
                             const at::Tensor& input, int64_t S);
  CommHandle reduce_scatter_per_rank(const at::Tensor& buffer, const at::Tensor& out,
                                     std::function<void()> average, int64_t S);
  CommHandle reduce_scatter_all_to_all(const at::Tensor& buffer, const at::Tensor& out,
                                       std::function<void()> average, int64_t S);
  // The backend's all-to-all, issued and counted as a collective (the callers
  // count their own bytes).
  c10::intrusive_ptr<compat::Work> issue_all_to_all(const at::Tensor& out, const at::Tensor& in,
                                                    const std::vector<int64_t>& out_splits,
                                                    const std::vector<int64_t>& in_splits);

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  int rank_, size_;
  std::string backend_name_;
  std::chrono::milliseconds timeout_;
  bool gloo_ = false;
  bool checked_ = false;
  std::shared_ptr<std::atomic<int64_t>> sequence_;  // the group's checked collectives so far
  // The check-in above (op: what the error calls the collective).
  void check_in(const char* op, int64_t numel, at::ScalarType dtype);
  FlatAlgorithm gather_algo_ = FlatAlgorithm::Native, reduce_scatter_algo_ = FlatAlgorithm::Native;
  std::atomic<int64_t> collectives_{0}, fallbacks_{0}, bytes_sent_{0}, bytes_copied_{0};
  std::atomic<int64_t> gathers_native_{0}, gathers_per_rank_{0};
  std::atomic<int64_t> reduce_scatters_native_{0}, reduce_scatters_per_rank_{0},
      reduce_scatters_all_to_all_{0};
};

// out <- pieces[0] + pieces[1] + ... + pieces[m-1], added in that (rank) order
// in out's dtype (pieces: [m, S], any dtype out holds exactly or rounds to).
// The one sum every rank-ordered reduction here uses.
void sum_in_rank_order(const at::Tensor& pieces, const at::Tensor& out);

}  // namespace rfsdp
