// The owner exchange: the pieces of a structure unit that shard boundaries cut
// (a row of Shampoo/SOAP tiles, a Muon matrix or block) go to the one rank that
// owns the unit, which works on it whole and sends every holder its piece of
// the result back. One all-to-all each way for all units; the splits are built
// once; the buffers live with the tensors (a GPU's for NCCL) and are filled by
// ATen copies (no host pointers), so the same path runs on a CPU and a GPU.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace rfsdp {

class Comm;

// Elements [begin, end) of source tensor `source`'s full flat tensor (a
// parameter's), processed whole by rank `owner`.
struct ExchangeUnit {
  size_t source;
  int64_t begin, end;
  int owner;
  int64_t numel() const { return end - begin; }
};

class OwnerExchange {
 public:
  using Range = std::pair<int64_t, int64_t>;
  OwnerExchange() = default;
  // ranges[s][r]: the elements [b, e) of source s that rank r holds (its local
  // flat tensor of s starts at b). replicated[s] (empty: none): every rank holds
  // all of s, so the owner reads its own copy (nothing travels to it) and sends
  // the whole result to every other rank.
  OwnerExchange(int rank, int world, std::vector<ExchangeUnit> units,
                std::vector<std::vector<Range>> ranges, std::vector<bool> replicated = {});

  int rank() const { return rank_; }
  int world() const { return world_; }
  size_t size() const { return units_.size(); }
  const std::vector<ExchangeUnit>& units() const { return units_; }
  bool owns(size_t u) const { return units_.at(u).owner == rank_; }
  // Rank r's elements of unit u (source coordinates; begin == end: none), and
  // what it sends the owner (none for a replicated unit but the owner's own).
  Range piece(size_t u, int r) const;
  Range gather_piece(size_t u, int r) const;
  // Unit u is owned here and this rank holds all of it (nothing travels for it
  // but, replicated, its result to the other ranks).
  bool held_whole_here(size_t u) const {
    const Range own = piece(u, rank_);
    return owns(u) && own.first == units_[u].begin && own.second == units_[u].end;
  }

  // To the owners: for each unit owned here, a [F, numel] tensor (F =
  // fields.size()) holding every holder's piece in place; undefined for the
  // others. fields[f][s]: this rank's flat tensor of source s (undefined: its
  // pieces travel as zeros). Collective (one all-to-all) when comm is set.
  // views: a unit held_whole_here comes as a view of its fields (read only:
  // no copy), where every field is defined.
  std::vector<at::Tensor> gather(Comm* comm, const std::vector<std::vector<at::Tensor>>& fields,
                                 bool views = false) const;
  // Back from the owners: results[u] ([F, numel] or, F = 1, [numel]; for units
  // owned here) written into out[f][s] at every holder's piece, the owner's own
  // included; an undefined out[f][s] takes nothing, an undefined results[u] of a
  // unit held_whole_here and not replicated is left to the caller. Collective
  // when comm is set.
  void scatter(Comm* comm, const std::vector<at::Tensor>& results,
               const std::vector<std::vector<at::Tensor>>& out) const;

  // Elements of one field this rank sends and receives per gather and scatter.
  int64_t gather_send_elems() const { return total(gather_send_); }
  int64_t gather_recv_elems() const { return total(gather_recv_); }
  int64_t scatter_send_elems() const { return total(scatter_send_); }
  int64_t scatter_recv_elems() const { return total(scatter_recv_); }
  const std::vector<int64_t>& gather_send_splits() const { return gather_send_; }
  const std::vector<int64_t>& gather_recv_splits() const { return gather_recv_; }
  const std::vector<int64_t>& scatter_send_splits() const { return scatter_send_; }
  const std::vector<int64_t>& scatter_recv_splits() const { return scatter_recv_; }

 private:
  // A piece on one side of an exchange: unit u's elements [begin, end) (source
  // coordinates), to or from rank peer.
  struct Part {
    size_t unit;
    int peer;
    int64_t begin, end;
  };
  static int64_t total(const std::vector<int64_t>& v);
  // Where this rank's flat tensor of the unit's source holds element `at`.
  int64_t local(size_t u, int64_t at) const;
  std::vector<int64_t> scaled(const std::vector<int64_t>& splits, int64_t f) const;

  int rank_ = 0, world_ = 1;
  std::vector<ExchangeUnit> units_;
  std::vector<std::vector<Range>> ranges_;
  std::vector<bool> replicated_;
  // By peer, then unit: what this rank sends and receives in each direction.
  std::vector<Part> gather_sends_, gather_recvs_, scatter_sends_, scatter_recvs_;
  std::vector<int64_t> gather_send_, gather_recv_, scatter_send_, scatter_recv_;
};

}  // namespace rfsdp
