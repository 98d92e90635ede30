// Muon's layout: where every matrix of the Muon parameters lives and which rank
// orthogonalises it.
//
// Matrices of a parameter of full shape s: 2-D, one s0 x s1 matrix; 3-D, an
// expert stack of s0 matrices s1 x s2; more dims, one s0 x (s1*s2*...) matrix.
// 0-D and 1-D parameters are refused (they belong with AdamW).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "core/comm/comm.h"
#include "core/ragged/tensor_shard.h"
#include "optimizers/common/owner_exchange.h"

namespace rfsdp {

struct MuonMatrix {
  size_t param = 0;     // index into the layout's parameters
  int64_t offset = 0;   // first element in the full (flattened) parameter
  int64_t rows = 0, cols = 0;
  // Column counts of its logical column blocks (split_dim 1), each orthogonalised
  // alone and scaled by its own rows x columns; empty: the matrix is one block.
  std::vector<int64_t> col_blocks;
  int root = 0;         // the rank that runs Newton–Schulz on it
  double flops = 0;     // Newton–Schulz flops
  bool replicated = false;  // every rank holds it whole: the root gathers nothing
  // Its parameter's column parts (TensorShard::col_parts): the exchange moves its
  // elements part after part, the root puts them side by side (1: as stored).
  int col_parts = 1;
  // A logical block of split_sizes' rows (a head): rooted on a rank holding part
  // of it, so a block that only some ranks cut (data parallelism inside one
  // tensor-parallel rank's heads) never travels to the others.
  bool row_block = false;
};

// Where every matrix lives and which rank orthogonalises it (its owner in the
// owner exchange, optimizers/common/owner_exchange.h). Built once per set of
// shards, each knowing every rank's rows (gather_rank_rows) where comm has more
// than one rank; collective: the ranks agree that they hold the same
// parameters, rows and Newton-Schulz steps (one all-reduce of a hash; the
// first difference named on every rank).
//
// Root selection: a matrix held by one rank is rooted there; the rest go
// longest-processing-time first (most flops first) to the least-loaded rank,
// ties to the rank holding most of the matrix, then the lowest rank; a
// split_sizes row block (a head) only to a rank holding part of it, so a head
// that tensor parallelism keeps on one tp rank crosses only dp. A
// parameter is replicated when every rank holds all of it (world > 1);
// otherwise the ranks' rows must tile it.
class MuonLayout {
 public:
  // comm may be null: one rank, every shard whole. ns_steps: one per shard.
  // split_sizes (empty, or one per shard; empty: whole matrices): counts along
  // each matrix's rows (split_dims[i] 0, the default; a 3-D stack: each
  // expert's) or columns (split_dims[i] 1: GPT-2's Conv1D fused QKV, stored
  // [in, 3 in], has its heads as column blocks), summing to them, each block its
  // own matrix for Newton–Schulz and the update's scale (heads, a fused QKV's
  // logical matrices). Row blocks are exchange units of their own (a rank
  // holding one whole orthogonalises it there); column blocks span every row, so
  // their matrix is the unit, split on its root. A shard whose plan carries
  // logical blocks (TensorShard::blocks, blocks_dim) takes them where
  // split_sizes gives none; both given and different is an error naming both.
  MuonLayout(Comm* comm, std::vector<TensorShard> shards, std::vector<int> ns_steps,
             std::vector<std::vector<int64_t>> split_sizes = {},
             std::vector<int> split_dims = {});
  // The layout rank 0 of `world` ranks computes from these shards (each with every
  // rank's rows), without a group and so without the ranks' agreement: for
  // planning tools (roots, loads and traffic at world sizes no test runs).
  static MuonLayout planned(int world, std::vector<TensorShard> shards, std::vector<int> ns_steps,
                            std::vector<std::vector<int64_t>> split_sizes = {},
                            std::vector<int> split_dims = {});

  int world() const { return exchange_.world(); }
  int rank() const { return exchange_.rank(); }
  const std::vector<TensorShard>& shards() const { return shards_; }
  int ns_steps(size_t i) const { return ns_steps_.at(i); }
  const std::vector<MuonMatrix>& matrices() const { return matrices_; }
  // The exchange of the matrices (unit k: matrix k, owned by its root).
  const OwnerExchange& exchange() const { return exchange_; }
  // Elements of matrix k on rank r: [begin, end) in the full parameter (empty when begin == end).
  std::pair<int64_t, int64_t> piece(size_t k, int r) const { return exchange_.piece(k, r); }
  // What rank r sends matrix k's root in the gather: its piece, none where the
  // matrix is replicated (the root holds it whole).
  std::pair<int64_t, int64_t> gather_piece(size_t k, int r) const { return exchange_.gather_piece(k, r); }
  bool replicated(size_t param) const { return replicated_.at(param); }
  // Newton–Schulz flops rooted on each rank, and max / mean of them (1 = balanced).
  std::vector<double> rank_flops() const;
  double flop_imbalance() const;
  // Elements this rank sends and receives per step in the gather, and in the
  // scatter (which sends each rank back its pieces, and a replicated matrix
  // whole to every rank but its root): what the all-to-alls move.
  int64_t gather_send_elems() const { return exchange_.gather_send_elems(); }
  int64_t gather_recv_elems() const { return exchange_.gather_recv_elems(); }
  int64_t scatter_send_elems() const { return exchange_.scatter_send_elems(); }
  int64_t scatter_recv_elems() const { return exchange_.scatter_recv_elems(); }

 private:
  MuonLayout(Comm* comm, int world, int rank, std::vector<TensorShard> shards,
             std::vector<int> ns_steps, std::vector<std::vector<int64_t>> split_sizes,
             std::vector<int> split_dims);
  std::vector<TensorShard> shards_;
  std::vector<int> ns_steps_;
  std::vector<std::vector<int64_t>> split_sizes_;
  std::vector<int> split_dims_;
  std::vector<MuonMatrix> matrices_;
  std::vector<bool> replicated_;  // [param]
  OwnerExchange exchange_;
};

}  // namespace rfsdp
