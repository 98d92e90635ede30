#include "core/comm/comm.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <iterator>
#include <memory>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <unordered_map>

namespace rfsdp {

namespace {

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

c10d::ReduceOp sum_op() { return c10d::ReduceOp(c10d::ReduceOp::SUM); }

// The collectives a check-in names (their codes travel in it).
const char* const kCheckedOps[] = {"all_gather_flat", "reduce_scatter_flat", "all_to_all",
                                   "all_reduce", "broadcast", "barrier"};

// Each process group's count of checked collectives, shared by every Comm over
// it (FSDP units and optimizers keep their own Comms over one group). Held
// weakly: a Comm holds its group, so while a count lives its group does and no
// other group can have its address; once every Comm over a group is gone, its
// count goes with it. (Holding the group itself weakly kept every group's object
// alive past its last user: Gloo's threads outlived what they used.)
std::shared_ptr<std::atomic<int64_t>> sequence_of(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  static std::mutex mu;
  static std::unordered_map<const c10d::ProcessGroup*, std::weak_ptr<std::atomic<int64_t>>> groups;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = groups.find(pg.get()); it != groups.end()) {
    if (auto count = it->second.lock()) return count;
  }
  for (auto it = groups.begin(); it != groups.end();) {
    it = it->second.expired() ? groups.erase(it) : std::next(it);
  }
  auto count = std::make_shared<std::atomic<int64_t>>(0);
  groups[pg.get()] = count;
  return count;
}

}  // namespace

CommHandle::CommHandle(std::vector<c10::intrusive_ptr<compat::Work>> works,
                       std::function<void()> finish, std::string what,
                       std::chrono::milliseconds timeout, int rank, int size, bool on_device)
    : works_(std::move(works)), finish_(std::move(finish)), what_(std::move(what)),
      timeout_(timeout), rank_(rank), size_(size), waited_(false), on_device_(on_device) {}

CommHandle CommHandle::after_event(std::shared_ptr<c10::Event> ready, std::string what) {
  CommHandle h;
  h.ready_ = std::move(ready);
  h.what_ = std::move(what);
  h.on_device_ = true;
  h.waited_ = false;
  return h;
}

CommHandle& CommHandle::operator=(CommHandle&& o) noexcept {
  if (this != &o) {
    works_ = std::move(o.works_);
    ready_ = std::move(o.ready_);
    finish_ = std::move(o.finish_);
    what_ = std::move(o.what_);
    timeout_ = o.timeout_;
    rank_ = o.rank_;
    size_ = o.size_;
    waited_ = o.waited_;
    on_device_ = o.on_device_;
    o.waited_ = true;  // the moved-from handle owns nothing to wait for
  }
  return *this;
}

CommHandle::~CommHandle() {
  // A handle dropped unwaited still completes its operation (fallback copy-outs
  // included); an error can only be reported, not thrown, from here.
  if (!waited_) {
    try {
      wait();
    } catch (const std::exception& e) {
      std::cerr << "rfsdp: an unwaited collective failed: " << e.what() << "\n";
    }
  }
}

CommHandle&& CommHandle::then(std::function<void()> next) && {
  if (waited_) {
    next();
  } else if (!finish_) {
    finish_ = std::move(next);
  } else {
    finish_ = [first = std::move(finish_), second = std::move(next)] {
      first();
      second();
    };
  }
  return std::move(*this);
}

CommHandle CommHandle::all(std::vector<CommHandle> handles) {
  if (handles.size() == 1) return std::move(handles.front());
  auto shared = std::make_shared<std::vector<CommHandle>>(std::move(handles));
  CommHandle h;
  h.finish_ = [shared] {
    for (CommHandle& x : *shared) x.wait();
  };
  h.what_ = "collectives";
  h.waited_ = false;
  return h;
}

void CommHandle::wait() {
  if (waited_) return;
  waited_ = true;
  try {
    // A timeout makes NCCL's wait block the host until done: on a GPU, wait
    // without one (a stream dependency); the process group's watchdog times out.
    for (auto& w : works_) w->wait(on_device_ ? ::kNoTimeout : timeout_);
  } catch (const std::exception& e) {
    std::string cause = e.what();
    if (const auto* ce = dynamic_cast<const c10::Error*>(&e)) cause = ce->what_without_backtrace();
    // Gloo says "Timed out", or under load "Application timeout caused pair closure".
    const bool timed_out = cause.find("imed out") != std::string::npos ||
                           cause.find("timeout") != std::string::npos;
    const bool lost = cause.find("Connection closed") != std::string::npos ||
                      cause.find("Connection reset") != std::string::npos;
    const std::string where = " on rank " + std::to_string(rank_) + " of " + std::to_string(size_);
    if (lost) {
      throw std::runtime_error(
          what_ + " failed" + where + ": the connection to a peer rank closed (its process died "
          "or left the group); restart every rank, from the last checkpoint. Backend said: " +
          cause);
    }
    if (timed_out) {
      throw std::runtime_error(
          what_ + " did not complete" + where + " within " + std::to_string(timeout_.count()) +
          " ms: a peer rank stopped taking part or is slower than the timeout (every rank must "
          "issue the same collectives in the same order). Backend said: " + cause);
    }
    throw std::runtime_error(what_ + " failed" + where + ": " + cause);
  }
  works_.clear();
  if (ready_) {
    // The current stream of the event's device (the caller's compute stream there).
    c10::impl::VirtualGuardImpl impl(ready_->device_type());
    ready_->block(impl.getStream(ready_->device()));
    ready_.reset();
  }
  if (finish_) finish_();
}

const char* to_string(FlatAlgorithm a) {
  switch (a) {
    case FlatAlgorithm::Auto: return "auto";
    case FlatAlgorithm::Native: return "native";
    case FlatAlgorithm::PerRank: return "per-rank";
    case FlatAlgorithm::AllToAll: return "all-to-all";
  }
  return "?";
}

Comm::Comm(c10::intrusive_ptr<c10d::ProcessGroup> pg, std::chrono::milliseconds timeout)
    : pg_(std::move(pg)), timeout_(timeout) {
  if (!pg_) throw std::invalid_argument("Comm needs a process group, got none");
  rank_ = pg_->getRank();
  size_ = pg_->getSize();
  backend_name_ = pg_->getBackendName();
  gloo_ = backend_name_ == "gloo";
  const char* check = std::getenv("RFSDP_CHECK_COLLECTIVES");
  checked_ = gloo_ && size_ > 1 && !(check && std::strcmp(check, "0") == 0);
  sequence_ = sequence_of(pg_);
  set_flat_algorithms(FlatAlgorithm::Auto, FlatAlgorithm::Auto);
}

void Comm::check_in(const char* op, int64_t numel, at::ScalarType dtype) {
  if (!checked_) return;
  int64_t code = 0;
  while (code < 6 && std::strcmp(kCheckedOps[code], op) != 0) ++code;
  const int64_t seq = (*sequence_)++;
  at::Tensor mine = at::tensor({seq, code, numel, static_cast<int64_t>(dtype)}, at::kLong);
  at::Tensor all = at::empty({size_ * 4}, at::kLong);
  c10d::AllgatherOptions opts;
  opts.timeout = timeout_;
  // (a peer that never comes: "<op> did not complete", as the collective itself would say)
  make_handle({group()._allgather_base(all, mine, opts)}, nullptr, op, at::Tensor()).wait();
  const int64_t* a = all.data_ptr<int64_t>();
  bool same = true;
  for (int r = 1; r < size_ && same; ++r) same = std::equal(a, a + 4, a + 4 * r);
  if (same) return;
  std::string text = "collectives out of step on a group of " + std::to_string(size_) + " ranks:";
  for (int r = 0; r < size_; ++r) {
    const int64_t* x = a + 4 * r;
    text += std::string(r ? "; " : " ") + "rank " + std::to_string(r) + " is at its collective #" +
            std::to_string(x[0]) + ", " + (x[1] >= 0 && x[1] < 6 ? kCheckedOps[x[1]] : "?") +
            (x[2] >= 0 ? " of " + std::to_string(x[2]) : std::string(" of")) + " " +
            c10::toString(static_cast<at::ScalarType>(x[3])) + " elements";
  }
  throw std::runtime_error(
      text + ". A rank skipped part of a step (an exception caught on one rank and training "
      "continued?) or the ranks run different code: every rank must issue the same collectives "
      "in the same order. Nothing was sent; restart every rank from the last checkpoint "
      "(RFSDP_CHECK_COLLECTIVES=0 turns this check off)");
}

std::shared_ptr<Comm> Comm::split(const std::vector<int>& ranks, const std::string& name) const {
  const std::string what = "Comm::split('" + name + "')";
  if (ranks.empty() || !std::is_sorted(ranks.begin(), ranks.end()) ||
      std::adjacent_find(ranks.begin(), ranks.end()) != ranks.end() || ranks.front() < 0 ||
      ranks.back() >= size_) {
    throw std::invalid_argument(what + ": ranks must be distinct, ascending ranks of this group "
                                "of " + std::to_string(size_));
  }
  if (!std::binary_search(ranks.begin(), ranks.end(), rank_)) {
    throw std::invalid_argument(what + ": rank " + std::to_string(rank_) +
                                " is not among the ranks; only members call split");
  }
  auto sub = group().splitGroup(ranks, timeout_, std::nullopt, name, name);
  if (!sub) throw std::runtime_error(what + ": the " + backend_name_ + " backend made no group");
  auto comm = std::make_shared<Comm>(sub, timeout_);
  comm->set_flat_algorithms(gather_algo_, reduce_scatter_algo_);
  return comm;
}

FlatAlgorithm Comm::resolve(FlatAlgorithm a, bool gather) const {
  if (a != FlatAlgorithm::Auto) return a;
  if (!gloo_) return FlatAlgorithm::Native;  // NCCL: in place, one call
  // Gloo (torch 2.11, CPU, 2 processes, slices of 16 Ki to 5.5 Mi floats): per-rank
  // broadcasts gathered 1.3-2.6x faster than the native all-gather (which stages
  // through a scratch buffer), per-rank reduces reduce-scattered 1.3-2.6x faster
  // from 1 Mi floats (the native one all-reduces a clone of the whole buffer) and
  // no slower below. bench_collectives prints both.
  // Beyond 2 ranks the reduce-scatter is chosen per call (reduce_scatter_auto).
  if (!gather && size_ > 2) return FlatAlgorithm::Auto;
  return FlatAlgorithm::PerRank;
}

FlatAlgorithm Comm::reduce_scatter_auto(int64_t slice_bytes) const {
  // Gloo beyond 2 ranks (bench_collectives --ranks M, threads on 2 cores): PerRank's
  // m reduces cost ~55 ms at 8 ranks and ~1.3 s at 32 whatever the size (m rounds
  // of a tree each); one all-to-all 4-13 ms for small units, but its staging and
  // m-piece sum lose from ~1 Mi floats a rank (8 ranks, 1.4 Mi floats a rank:
  // 170 ms against PerRank's 118 ms).
  return slice_bytes <= (int64_t{4} << 20) ? FlatAlgorithm::AllToAll : FlatAlgorithm::PerRank;
}

void Comm::set_flat_algorithms(FlatAlgorithm gather, FlatAlgorithm reduce_scatter) {
  if (gather == FlatAlgorithm::AllToAll) {
    throw std::invalid_argument("all_gather_flat has no all-to-all algorithm (reduce-scatter only)");
  }
  gather_algo_ = resolve(gather, true);
  reduce_scatter_algo_ = resolve(reduce_scatter, false);
}

void Comm::close() { pg_.reset(); }

at::Device Comm::control_device() const {
  const bool nccl = backend_name_.find("nccl") != std::string::npos;
  const bool gloo = backend_name_.find("gloo") != std::string::npos;
  if (nccl && !gloo) {
    return c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getDevice();
  }
  return at::kCPU;
}

c10d::ProcessGroup& Comm::group() const {
  if (!pg_) {
    throw std::logic_error("Comm (rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
                           ", " + backend_name_ + ") was closed; it issues no more collectives");
  }
  return *pg_;
}

CommStats Comm::stats() const {
  CommStats s;
  s.collectives = collectives_;
  s.fallbacks = fallbacks_;
  s.gathers_native = gathers_native_;
  s.gathers_per_rank = gathers_per_rank_;
  s.reduce_scatters_native = reduce_scatters_native_;
  s.reduce_scatters_per_rank = reduce_scatters_per_rank_;
  s.reduce_scatters_all_to_all = reduce_scatters_all_to_all_;
  s.bytes_sent = bytes_sent_;
  s.bytes_copied = bytes_copied_;
  return s;
}

void Comm::reset_stats() {
  collectives_ = fallbacks_ = bytes_sent_ = bytes_copied_ = 0;
  gathers_native_ = gathers_per_rank_ = reduce_scatters_native_ = reduce_scatters_per_rank_ = 0;
  reduce_scatters_all_to_all_ = 0;
}

void Comm::check_flat(const at::Tensor& t, const char* what) const {
  if (!t.defined()) throw std::invalid_argument(std::string(what) + ": tensor is undefined");
  if (t.dim() != 1 || !t.is_contiguous()) {
    throw std::invalid_argument(std::string(what) + ": needs a contiguous 1-D tensor, got sizes " +
                                c10::str(t.sizes()));
  }
}

CommHandle Comm::make_handle(std::vector<c10::intrusive_ptr<compat::Work>> works,
                             std::function<void()> finish, const std::string& what,
                             const at::Tensor& on) {
  const bool on_device = on.defined() && !on.device().is_cpu();
  return CommHandle(std::move(works), std::move(finish), what, timeout_, rank_, size_, on_device);
}

CommHandle Comm::all_gather_flat(const at::Tensor& buffer, const at::Tensor& local) {
  check_flat(buffer, "all_gather_flat buffer");
  if (buffer.numel() % size_ != 0) {
    throw std::invalid_argument("all_gather_flat: buffer of " + std::to_string(buffer.numel()) +
                                " elements is not m*S for world size " + std::to_string(size_));
  }
  check_in("all_gather_flat", buffer.numel(), buffer.scalar_type());
  const int64_t S = buffer.numel() / size_;
  at::Tensor slice = buffer.narrow(0, rank_ * S, S);
  at::Tensor input = slice;
  if (local.defined()) {
    check_flat(local, "all_gather_flat local");
    if (local.numel() != S || local.scalar_type() != buffer.scalar_type() ||
        local.device() != buffer.device()) {
      throw std::invalid_argument("all_gather_flat: local must be " + std::to_string(S) + " " +
                                  std::string(c10::toString(buffer.scalar_type())) +
                                  " elements on the buffer's device");
    }
    input = local;
  }
  bytes_sent_ += nbytes(input);
  if (gather_algo_ == FlatAlgorithm::Native) {
    try {
      c10d::AllgatherOptions opts;
      opts.timeout = timeout_;
      at::Tensor out = buffer, in = input;
      auto work = group()._allgather_base(out, in, opts);
      ++collectives_;
      ++gathers_native_;
      // Gloo gathers into a scratch buffer (the own input copied in) and copies
      // every slice out of it.
      if (gloo_) bytes_copied_ += nbytes(buffer) + nbytes(input);
      return make_handle({work}, nullptr, "all_gather_flat", buffer);
    } catch (const c10::Error& e) {
      if (!compat::is_unsupported_op(e)) throw;
      gather_algo_ = FlatAlgorithm::PerRank;  // this backend lacks it: every rank alike
    }
  }
  return gather_per_rank(buffer, slice, input, S);
}

CommHandle Comm::gather_per_rank(const at::Tensor& buffer, const at::Tensor& slice,
                                 const at::Tensor& input, int64_t S) {
  // Each rank broadcasts its slice in place; nothing is copied but the local
  // input into the rank's own slice (when it is not the slice).
  ++fallbacks_;
  ++gathers_per_rank_;
  if (input.data_ptr() != slice.data_ptr()) {
    slice.copy_(input);
    bytes_copied_ += nbytes(slice);
  }
  std::vector<c10::intrusive_ptr<compat::Work>> works;
  for (int r = 0; r < size_; ++r) {
    std::vector<at::Tensor> t{buffer.narrow(0, r * S, S)};
    c10d::BroadcastOptions opts;
    opts.rootRank = r;
    opts.timeout = timeout_;
    works.push_back(group().broadcast(t, opts));
    ++collectives_;
  }
  return make_handle(std::move(works), nullptr, "all_gather_flat (per-rank broadcasts)", buffer);
}

CommHandle Comm::reduce_scatter_flat(const at::Tensor& buffer, const at::Tensor& out,
                                     ReduceOp op) {
  check_flat(buffer, "reduce_scatter_flat buffer");
  check_flat(out, "reduce_scatter_flat out");
  const int64_t S = out.numel();
  if (buffer.numel() != S * size_ || out.scalar_type() != buffer.scalar_type()) {
    throw std::invalid_argument("reduce_scatter_flat: buffer must be world size (" +
                                std::to_string(size_) + ") x out (" + std::to_string(S) +
                                ") elements of one dtype, got " + std::to_string(buffer.numel()));
  }
  if (op == ReduceOp::Max) throw std::invalid_argument("reduce_scatter_flat: Sum or Avg only");
  check_in("reduce_scatter_flat", buffer.numel(), buffer.scalar_type());
  const double scale = op == ReduceOp::Avg ? 1.0 / size_ : 1.0;
  auto average = [out, scale] {
    if (scale != 1.0) out.mul_(scale);
  };
  bytes_sent_ += nbytes(buffer);
  const FlatAlgorithm algo = reduce_scatter_algo_ == FlatAlgorithm::Auto
                                ? reduce_scatter_auto(nbytes(out))
                                : reduce_scatter_algo_;
  if (algo == FlatAlgorithm::Native) {
    try {
      c10d::ReduceScatterOptions opts;
      opts.reduceOp = sum_op();
      opts.timeout = timeout_;
      at::Tensor o = out, b = buffer;
      auto work = group()._reduce_scatter_base(o, b, opts);
      ++collectives_;
      ++reduce_scatters_native_;
      // Gloo clones the whole buffer, all-reduces the clone, copies the own slice out.
      if (gloo_) bytes_copied_ += nbytes(buffer) + nbytes(out);
      return make_handle({work}, average, "reduce_scatter_flat", buffer);
    } catch (const c10::Error& e) {
      if (!compat::is_unsupported_op(e)) throw;
      reduce_scatter_algo_ = FlatAlgorithm::PerRank;
    }
  }
  if (algo == FlatAlgorithm::AllToAll) {
    return reduce_scatter_all_to_all(buffer, out, std::move(average), S);
  }
  return reduce_scatter_per_rank(buffer, out, std::move(average), S);
}

CommHandle Comm::reduce_scatter_all_to_all(const at::Tensor& buffer, const at::Tensor& out,
                                           std::function<void()> average, int64_t S) {
  ++reduce_scatters_all_to_all_;
  // The pieces land in a scratch of the buffer's size, then are summed into out.
  const at::Tensor pieces = at::empty({size_ * S}, buffer.options());
  bytes_copied_ += nbytes(buffer) + nbytes(out);
  const std::vector<int64_t> splits(size_, S);
  auto work = issue_all_to_all(pieces, buffer, splits, splits);
  const int64_t m = size_;
  return make_handle(
      {work},
      [pieces, out, m, S, average = std::move(average)] {
        sum_in_rank_order(pieces.view({m, S}), out);
        average();
      },
      "reduce_scatter_flat (all-to-all)", buffer);
}

void sum_in_rank_order(const at::Tensor& pieces, const at::Tensor& out) {
  out.copy_(pieces[0]);
  for (int64_t r = 1; r < pieces.size(0); ++r) out.add_(pieces[r]);
}

CommHandle Comm::reduce_scatter_per_rank(const at::Tensor& buffer, const at::Tensor& out,
                                         std::function<void()> average, int64_t S) {
  // One in-place reduce per slice, rooted at the slice's owner; the result is
  // then copied out of the rank's own slice (unless out is that slice).
  ++fallbacks_;
  ++reduce_scatters_per_rank_;
  std::vector<c10::intrusive_ptr<compat::Work>> works;
  for (int r = 0; r < size_; ++r) {
    std::vector<at::Tensor> t{buffer.narrow(0, r * S, S)};
    c10d::ReduceOptions opts;
    opts.reduceOp = sum_op();
    opts.rootRank = r;
    opts.timeout = timeout_;
    works.push_back(group().reduce(t, opts));
    ++collectives_;
  }
  at::Tensor own = buffer.narrow(0, rank_ * S, S);
  const bool copy = own.data_ptr() != out.data_ptr();
  if (copy) bytes_copied_ += nbytes(out);
  return make_handle(
      std::move(works),
      [own, out, copy, average = std::move(average)] {
        if (copy) out.copy_(own);
        average();
      },
      "reduce_scatter_flat (per-rank reduces)", buffer);
}

CommHandle Comm::all_to_all(const at::Tensor& out, const at::Tensor& in,
                            const std::vector<int64_t>& out_splits,
                            const std::vector<int64_t>& in_splits) {
  check_flat(out, "all_to_all out");
  check_flat(in, "all_to_all in");
  if (static_cast<int>(out_splits.size()) != size_ || static_cast<int>(in_splits.size()) != size_) {
    throw std::invalid_argument("all_to_all: need one split per rank (" + std::to_string(size_) +
                                ")");
  }
  const int64_t out_total = std::accumulate(out_splits.begin(), out_splits.end(), int64_t{0});
  const int64_t in_total = std::accumulate(in_splits.begin(), in_splits.end(), int64_t{0});
  if (out_total != out.numel() || in_total != in.numel()) {
    throw std::invalid_argument("all_to_all: splits add up to " + std::to_string(out_total) + "/" +
                                std::to_string(in_total) + " elements, tensors hold " +
                                std::to_string(out.numel()) + "/" + std::to_string(in.numel()));
  }
  check_in("all_to_all", -1, in.scalar_type());  // (each rank sends its own count)
  bytes_sent_ += (in_total - in_splits[rank_]) * static_cast<int64_t>(in.element_size());
  return make_handle({issue_all_to_all(out, in, out_splits, in_splits)}, nullptr, "all_to_all", out);
}

c10::intrusive_ptr<compat::Work> Comm::issue_all_to_all(const at::Tensor& out, const at::Tensor& in,
                                                        const std::vector<int64_t>& out_splits,
                                                        const std::vector<int64_t>& in_splits) {
  c10d::AllToAllOptions opts;
  opts.timeout = timeout_;
  at::Tensor o = out, i = in;
  std::vector<int64_t> os = out_splits, is = in_splits;
  auto work = group().alltoall_base(o, i, os, is, opts);
  ++collectives_;
  return work;
}

CommHandle Comm::all_reduce(const at::Tensor& t, ReduceOp op) {
  if (!t.defined() || !t.is_contiguous()) {
    throw std::invalid_argument("all_reduce: needs a defined contiguous tensor");
  }
  check_in("all_reduce", t.numel(), t.scalar_type());
  bytes_sent_ += nbytes(t);
  std::vector<at::Tensor> ts{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = op == ReduceOp::Max ? c10d::ReduceOp(c10d::ReduceOp::MAX) : sum_op();
  opts.timeout = timeout_;
  auto work = group().allreduce(ts, opts);
  ++collectives_;
  const double scale = op == ReduceOp::Avg ? 1.0 / size_ : 1.0;
  return make_handle(
      {work},
      [t, scale] {
        if (scale != 1.0) t.mul_(scale);
      },
      "all_reduce", t);
}

CommHandle Comm::broadcast(const at::Tensor& t, int root) {
  if (!t.defined() || !t.is_contiguous()) {
    throw std::invalid_argument("broadcast: needs a defined contiguous tensor");
  }
  if (root < 0 || root >= size_) {
    throw std::invalid_argument("broadcast: root " + std::to_string(root) +
                                " out of range for world size " + std::to_string(size_));
  }
  check_in("broadcast", t.numel(), t.scalar_type());
  if (rank_ == root) bytes_sent_ += nbytes(t);
  std::vector<at::Tensor> ts{t};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  opts.timeout = timeout_;
  auto work = group().broadcast(ts, opts);
  ++collectives_;
  return make_handle({work}, nullptr, "broadcast", t);
}

CommHandle Comm::barrier() {
  check_in("barrier", 0, at::kByte);
  c10d::BarrierOptions opts;
  opts.timeout = timeout_;
  // torch's ProcessGroup::barrier assigns a function-static tensor before it enqueues
  // the collective: ranks as threads of one process that call it at once race on that
  // tensor's reference count and corrupt the heap (HsdpMesh (16, 8): "malloc():
  // unaligned tcache chunk" in 2 runs of 12). The call only enqueues (the wait is the
  // handle's), so the lock is held briefly; across processes it is never contended.
  static std::mutex barrier_call;
  std::unique_lock<std::mutex> lock(barrier_call);
  auto work = group().barrier(opts);
  lock.unlock();
  ++collectives_;
  return make_handle({work}, nullptr, "barrier", at::Tensor());
}

}  // namespace rfsdp
