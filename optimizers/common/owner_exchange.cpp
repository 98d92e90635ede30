#include "optimizers/common/owner_exchange.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>

#include "core/comm/comm.h"

namespace rfsdp {

int64_t OwnerExchange::total(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

OwnerExchange::OwnerExchange(int rank, int world, std::vector<ExchangeUnit> units,
                             std::vector<std::vector<Range>> ranges, std::vector<bool> replicated)
    : rank_(rank), world_(world), units_(std::move(units)), ranges_(std::move(ranges)),
      replicated_(std::move(replicated)) {
  if (replicated_.empty()) replicated_.assign(ranges_.size(), false);
  for (const ExchangeUnit& u : units_) {
    if (u.source >= ranges_.size() || static_cast<int>(ranges_[u.source].size()) != world_ ||
        u.owner < 0 || u.owner >= world_ || u.begin > u.end) {
      throw std::invalid_argument("OwnerExchange: a unit of source " + std::to_string(u.source) +
                                  " needs every rank's range of it and an owner among the " +
                                  std::to_string(world_) + " ranks");
    }
  }
  for (auto* s : {&gather_send_, &gather_recv_, &scatter_send_, &scatter_recv_}) s->assign(world_, 0);
  for (size_t u = 0; u < units_.size(); ++u) {
    const int owner = units_[u].owner;
    for (int r = 0; r < world_; ++r) {
      if (r == owner) continue;
      const Range g = gather_piece(u, r), b = piece(u, r);
      if (owner == rank_) {
        if (g.second > g.first) gather_recvs_.push_back({u, r, g.first, g.second});
        if (b.second > b.first) scatter_sends_.push_back({u, r, b.first, b.second});
      } else if (r == rank_) {
        if (g.second > g.first) gather_sends_.push_back({u, owner, g.first, g.second});
        if (b.second > b.first) scatter_recvs_.push_back({u, owner, b.first, b.second});
      }
    }
  }
  auto by_peer = [](const Part& a, const Part& b) { return a.peer < b.peer; };
  for (auto* parts : {&gather_sends_, &gather_recvs_, &scatter_sends_, &scatter_recvs_}) {
    std::stable_sort(parts->begin(), parts->end(), by_peer);
  }
  for (const Part& p : gather_sends_) gather_send_[p.peer] += p.end - p.begin;
  for (const Part& p : gather_recvs_) gather_recv_[p.peer] += p.end - p.begin;
  for (const Part& p : scatter_sends_) scatter_send_[p.peer] += p.end - p.begin;
  for (const Part& p : scatter_recvs_) scatter_recv_[p.peer] += p.end - p.begin;
}

OwnerExchange::Range OwnerExchange::piece(size_t u, int r) const {
  const ExchangeUnit& x = units_.at(u);
  const Range& range = ranges_[x.source][r];
  const int64_t b = std::max(x.begin, range.first), e = std::min(x.end, range.second);
  return b < e ? Range{b, e} : Range{b, b};
}

OwnerExchange::Range OwnerExchange::gather_piece(size_t u, int r) const {
  const ExchangeUnit& x = units_.at(u);
  if (replicated_[x.source] && r != x.owner) return {x.begin, x.begin};
  return piece(u, r);
}

int64_t OwnerExchange::local(size_t u, int64_t at) const {
  return at - ranges_[units_[u].source][rank_].first;
}

std::vector<int64_t> OwnerExchange::scaled(const std::vector<int64_t>& splits, int64_t f) const {
  std::vector<int64_t> out(splits);
  for (int64_t& s : out) s *= f;
  return out;
}

namespace {

// The options of the first defined tensor (the buffers live with the tensors).
at::TensorOptions options_of(const std::vector<std::vector<at::Tensor>>& fields,
                             const std::vector<at::Tensor>& more = {}) {
  for (const auto& f : fields) {
    for (const at::Tensor& t : f) {
      if (t.defined()) return t.options();
    }
  }
  for (const at::Tensor& t : more) {
    if (t.defined()) return t.options();
  }
  return at::TensorOptions(at::kFloat);
}

}  // namespace

std::vector<at::Tensor> OwnerExchange::gather(Comm* comm,
                                              const std::vector<std::vector<at::Tensor>>& fields,
                                              bool views) const {
  const int64_t F = static_cast<int64_t>(fields.size());
  const at::TensorOptions opts = options_of(fields);
  std::vector<at::Tensor> out(units_.size());
  for (size_t u = 0; u < units_.size(); ++u) {
    if (!owns(u)) continue;
    if (views && F == 1 && held_whole_here(u) && fields[0][units_[u].source].defined()) {
      out[u] = fields[0][units_[u].source].narrow(0, local(u, units_[u].begin), units_[u].numel())
                   .unsqueeze(0);
      continue;
    }
    out[u] = at::zeros({F, units_[u].numel()}, opts);
    const Range own = gather_piece(u, rank_);  // the owner's own piece: no travel
    const int64_t n = own.second - own.first;
    if (n == 0) continue;
    for (int64_t f = 0; f < F; ++f) {
      const at::Tensor& src = fields[f][units_[u].source];
      if (src.defined()) {
        out[u][f].narrow(0, own.first - units_[u].begin, n).copy_(src.narrow(0, local(u, own.first), n));
      }
    }
  }
  if (!comm || world_ == 1) return out;
  at::Tensor send = at::zeros({F * gather_send_elems()}, opts);
  at::Tensor recv = at::empty({F * gather_recv_elems()}, opts);
  int64_t at_ = 0;
  for (const Part& p : gather_sends_) {
    const int64_t n = p.end - p.begin;
    for (int64_t f = 0; f < F; ++f, at_ += n) {
      const at::Tensor& src = fields[f][units_[p.unit].source];
      if (src.defined()) send.narrow(0, at_, n).copy_(src.narrow(0, local(p.unit, p.begin), n));
    }
  }
  comm->all_to_all(recv, send, scaled(gather_recv_, F), scaled(gather_send_, F)).wait();
  at_ = 0;
  for (const Part& p : gather_recvs_) {
    const int64_t n = p.end - p.begin;
    for (int64_t f = 0; f < F; ++f, at_ += n) {
      out[p.unit][f].narrow(0, p.begin - units_[p.unit].begin, n).copy_(recv.narrow(0, at_, n));
    }
  }
  return out;
}

void OwnerExchange::scatter(Comm* comm, const std::vector<at::Tensor>& results,
                            const std::vector<std::vector<at::Tensor>>& out) const {
  const int64_t F = static_cast<int64_t>(out.size());
  auto field = [&](size_t u, int64_t f) {
    const at::Tensor& r = results.at(u);
    return r.dim() == 1 ? r : r[f];
  };
  for (size_t u = 0; u < units_.size(); ++u) {
    if (!owns(u) || !results.at(u).defined()) continue;
    const Range own = piece(u, rank_);
    const int64_t n = own.second - own.first;
    if (n == 0) continue;
    for (int64_t f = 0; f < F; ++f) {
      const at::Tensor& dst = out[f][units_[u].source];
      if (dst.defined()) {
        dst.narrow(0, local(u, own.first), n).copy_(field(u, f).narrow(0, own.first - units_[u].begin, n));
      }
    }
  }
  if (!comm || world_ == 1) return;
  const at::TensorOptions opts = options_of(out, results);
  at::Tensor send = at::empty({F * scatter_send_elems()}, opts);
  at::Tensor recv = at::empty({F * scatter_recv_elems()}, opts);
  int64_t at_ = 0;
  for (const Part& p : scatter_sends_) {
    const int64_t n = p.end - p.begin;
    for (int64_t f = 0; f < F; ++f, at_ += n) {
      send.narrow(0, at_, n).copy_(field(p.unit, f).narrow(0, p.begin - units_[p.unit].begin, n));
    }
  }
  comm->all_to_all(recv, send, scaled(scatter_recv_, F), scaled(scatter_send_, F)).wait();
  at_ = 0;
  for (const Part& p : scatter_recvs_) {
    const int64_t n = p.end - p.begin;
    for (int64_t f = 0; f < F; ++f, at_ += n) {
      const at::Tensor& dst = out[f][units_[p.unit].source];
      if (dst.defined()) dst.narrow(0, local(p.unit, p.begin), n).copy_(recv.narrow(0, at_, n));
    }
  }
}

}  // namespace rfsdp
