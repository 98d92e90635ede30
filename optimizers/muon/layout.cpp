#include "optimizers/muon/layout.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>

#include "core/comm/agree.h"
#include "core/ragged/tensor_spec.h"
#include "optimizers/common/lpt.h"
#include "optimizers/common/matrices.h"
#include "optimizers/muon/newton_schulz.h"

namespace rfsdp {
namespace {

// [rank]: the elements of the full parameter that rank holds.
using Ranges = std::vector<OwnerExchange::Range>;

// Checks: one value per shard.
void check_one_per_shard(size_t given, size_t shards, const std::string& what) {
  if (given != shards) {
    throw std::invalid_argument("Muon: " + std::to_string(given) + " " + what + " values for " +
                                std::to_string(shards) + " parameters");
  }
}

// Checks: a shard Muon can take (a matrix, positive steps, every rank's rows known).
void check_shard(const TensorShard& p, int ns_steps, int world) {
  if (p.shape.size() < 2) {
    throw std::invalid_argument(
        "Muon: parameter '" + p.name + "' has shape " + shape_to_string(p.shape) +
        ": Muon orthogonalises matrices (2-D weights, 3-D expert stacks); give 0-D and 1-D "
        "parameters (biases, norm weights) to AdamW (a use_muon=False group)");
  }
  if (ns_steps < 1) {
    throw std::invalid_argument("Muon: parameter '" + p.name +
                                "': ns_steps must be a positive integer, got " +
                                std::to_string(ns_steps));
  }
  if (world > 1 && static_cast<int>(p.rank_rows.size()) != world) {
    throw std::invalid_argument("Muon: parameter '" + p.name + "': the layout needs every "
                                "rank's rows (gather_rank_rows)");
  }
}

// Splits: the plan's logical blocks (TensorShard::blocks) are the split unless
// the group gives one; both given and different is an error naming both.
void take_plan_blocks(const TensorShard& p, std::vector<int64_t>* split, int* dim) {
  if (p.blocks.empty()) return;
  if (split->empty()) {
    *split = p.blocks;
    *dim = p.blocks_dim;
  } else if (*split != p.blocks || *dim != p.blocks_dim) {
    throw std::invalid_argument("Muon: parameter '" + p.name + "': its group's split_sizes " +
                                shape_to_string(*split) + " (split_dim " + std::to_string(*dim) +
                                ") differ from the logical blocks its plan keeps whole, " +
                                shape_to_string(p.blocks) + " (split_dim " +
                                std::to_string(p.blocks_dim) +
                                ", rfsdp.policy.muon(split=...)); give one of them");
  }
}

// Splits: blocks of each matrix's rows (columns), summing to them; refused in
// the planner's words.
void check_split_fits(const TensorShard& p, const std::vector<int64_t>& split, int dim) {
  if (split.empty()) return;
  try {
    block_granule_rows(p.name, p.shape, p.shape.size() == 3 ? 2 : 1, split, dim);
  } catch (const std::invalid_argument& e) {
    std::string what = e.what();
    const std::string tensor = "tensor '" + p.name + "': ";
    if (what.rfind(tensor, 0) == 0) what = what.substr(tensor.size());
    throw std::invalid_argument("Muon: parameter '" + p.name + "' of shape " +
                                shape_to_string(p.shape) + ": split_sizes " +
                                shape_to_string(split) + " do not fit it: " + what);
  }
}

// Agreement: what every rank must hold alike about a shard (its parameter,
// steps, split and every rank's rows), one line; the ranks then agree on the
// lines' hash (one all-reduce; the first difference named on every rank).
std::string agreement_line(const TensorShard& p, int ns_steps, const std::vector<int64_t>& split,
                           int dim, int world, int rank) {
  std::string line = p.name + " " + shape_to_string(p.shape) + " ns_steps " +
                     std::to_string(ns_steps) + " split" + (dim == 1 ? " columns" : "");
  for (int64_t s : split) line += " " + std::to_string(s);
  line += " rows";
  for (const auto& [b, e] : p.rank_rows) {
    line += " [" + std::to_string(b) + ", " + std::to_string(e) + ")";
  }
  if (world > 1 && p.rank_rows[rank] != std::make_pair(p.row_begin, p.row_end)) {
    // (a line of its own: every rank then fails in agree_lines, naming it)
    line += "; but rank " + std::to_string(rank) + " holds [" + std::to_string(p.row_begin) +
            ", " + std::to_string(p.row_end) + ")";
  }
  return line;
}

// The elements of the full parameter each rank holds (one rank: this shard's).
Ranges rank_ranges(const TensorShard& p, int world) {
  if (world == 1) return {{p.row_begin * p.row_len, p.row_end * p.row_len}};
  Ranges out;
  for (const auto& [b, e] : p.rank_rows) out.emplace_back(b * p.row_len, e * p.row_len);
  return out;
}

// Replication: true where every rank holds all of the parameter (DDP). Else
// the ranks' shards must tile it (disjoint, together everything): refused if not.
bool is_replicated(const TensorShard& p, const Ranges& rs, int world) {
  const int64_t n = p.full_numel();
  if (world > 1 && std::all_of(rs.begin(), rs.end(), [n](const auto& x) {
        return x.first == 0 && x.second == n;
      })) {
    return true;
  }
  std::vector<std::pair<int64_t, int64_t>> sorted;
  for (const auto& x : rs) {
    if (x.first < x.second) sorted.push_back(x);
  }
  std::sort(sorted.begin(), sorted.end());
  int64_t covered = 0;
  for (const auto& x : sorted) {
    if (x.first != covered) {
      throw std::invalid_argument(
          "Muon: the ranks' shards of '" + p.name + "' do not tile it (a gap or an "
          "overlap at element " + std::to_string(std::min(x.first, covered)) +
          "); give each rank its own shard (fully_shard's or FSDP2's parameters) or every "
          "rank the whole tensor (replicated: DDP), not a mix; under HSDP, build Muon over "
          "the shard group (its default), not the whole world");
    }
    covered = x.second;
  }
  if (covered != n) {
    throw std::invalid_argument("Muon: the ranks' shards of '" + p.name + "' cover " +
                                std::to_string(covered) + " of its " + std::to_string(n) +
                                " elements");
  }
  return false;
}

// Matrices: parameter `param`'s, in order. Row blocks are matrices of their own
// (exchange units: a rank holding one whole orthogonalises it there); column
// blocks span every row, so their matrix is the unit, split on its root.
void append_matrices(size_t param, const TensorShard& p, const std::vector<int64_t>& split, int dim,
                     int steps, bool replicated, std::vector<MuonMatrix>* out) {
  if (p.col_parts > 1 && !split.empty()) {
    throw std::invalid_argument("Muon: parameter '" + p.name + "' is held in " +
                                std::to_string(p.col_parts) + " column parts (tensor "
                                "parallelism's Shard(1)): split_sizes are not supported for it "
                                "yet; give it whole");
  }
  for (const MatrixView& m : matrices_of(p.shape)) {
    if (m.rows * m.cols == 0) continue;
    MuonMatrix mat;
    mat.col_parts = p.col_parts;
    mat.param = param;
    mat.cols = m.cols;
    mat.replicated = replicated;
    if (dim == 1) {
      mat.offset = m.offset;
      mat.rows = m.rows;
      mat.col_blocks = split;
      for (int64_t c : split) mat.flops += newton_schulz_flops(m.rows, c, steps);
      out->push_back(mat);
      continue;
    }
    int64_t row0 = 0;
    mat.row_block = !split.empty();
    for (int64_t rows : split.empty() ? std::vector<int64_t>{m.rows} : split) {
      mat.offset = m.offset + row0 * m.cols;
      mat.rows = rows;
      mat.flops = newton_schulz_flops(rows, m.cols, steps);
      out->push_back(mat);
      row0 += rows;
    }
  }
}

// Roots (LPT): a matrix held by one rank stays there; the rest go costliest
// first to the least-loaded rank (a split_sizes row block: of those holding
// part of it), ties to the rank holding most of the matrix.
std::vector<int> lpt_roots(const std::vector<MuonMatrix>& mats, const std::vector<Ranges>& ranges,
                           int world) {
  std::vector<WorkItem> items(mats.size());
  for (size_t k = 0; k < mats.size(); ++k) {
    const MuonMatrix& m = mats[k];
    items[k].cost = m.flops;
    items[k].affinity.assign(world, 0);
    int holders = 0, holder = 0;
    for (int r = 0; r < world; ++r) {
      const auto& range = ranges[m.param][r];
      const int64_t held = std::max<int64_t>(
          0, std::min(m.offset + m.rows * m.cols, range.second) - std::max(m.offset, range.first));
      items[k].affinity[r] = held;
      if (held > 0) ++holders, holder = r;
    }
    if (holders == 1) items[k].fixed_rank = holder;
    items[k].holders_only = m.row_block && !m.replicated;
  }
  return assign_lpt(items, world);
}

}  // namespace

MuonLayout::MuonLayout(Comm* comm, std::vector<TensorShard> shards, std::vector<int> ns_steps,
                       std::vector<std::vector<int64_t>> split_sizes, std::vector<int> split_dims)
    : MuonLayout(comm, comm ? comm->size() : 1, comm ? comm->rank() : 0, std::move(shards),
                 std::move(ns_steps), std::move(split_sizes), std::move(split_dims)) {}

MuonLayout MuonLayout::planned(int world, std::vector<TensorShard> shards, std::vector<int> ns_steps,
                               std::vector<std::vector<int64_t>> split_sizes,
                               std::vector<int> split_dims) {
  return MuonLayout(nullptr, world, 0, std::move(shards), std::move(ns_steps), std::move(split_sizes),
                    std::move(split_dims));
}

MuonLayout::MuonLayout(Comm* comm, int world, int rank, std::vector<TensorShard> shards,
                       std::vector<int> ns_steps, std::vector<std::vector<int64_t>> split_sizes,
                       std::vector<int> split_dims)
    : shards_(std::move(shards)), ns_steps_(std::move(ns_steps)), split_sizes_(std::move(split_sizes)),
      split_dims_(std::move(split_dims)) {
  const size_t P = shards_.size();
  check_one_per_shard(ns_steps_.size(), P, "ns_steps");
  if (split_sizes_.empty()) split_sizes_.resize(P);  // (none: whole matrices)
  check_one_per_shard(split_sizes_.size(), P, "split_sizes");
  if (split_dims_.empty()) split_dims_.resize(P, 0);  // (none: rows)
  check_one_per_shard(split_dims_.size(), P, "split_dim");
  std::vector<Ranges> ranges(P);
  std::vector<std::string> lines;
  for (size_t i = 0; i < P; ++i) {
    const TensorShard& p = shards_[i];
    check_shard(p, ns_steps_[i], world);
    take_plan_blocks(p, &split_sizes_[i], &split_dims_[i]);
    check_split_fits(p, split_sizes_[i], split_dims_[i]);
    lines.push_back(agreement_line(p, ns_steps_[i], split_sizes_[i], split_dims_[i], world, rank));
    ranges[i] = rank_ranges(p, world);
  }
  if (comm && world > 1) {
    agree_lines(*comm, lines, "Muon's parameters (build the optimizer from the same model on "
                              "every rank)");
  }
  replicated_.assign(P, false);
  for (size_t i = 0; i < P; ++i) {
    replicated_[i] = is_replicated(shards_[i], ranges[i], world);
    append_matrices(i, shards_[i], split_sizes_[i], split_dims_[i], ns_steps_[i], replicated_[i],
                    &matrices_);
  }
  const std::vector<int> roots = lpt_roots(matrices_, ranges, world);
  std::vector<ExchangeUnit> units;
  for (size_t k = 0; k < matrices_.size(); ++k) {
    MuonMatrix& m = matrices_[k];
    m.root = roots[k];
    units.push_back({m.param, m.offset, m.offset + m.rows * m.cols, m.root});
  }
  exchange_ = OwnerExchange(rank, world, std::move(units), std::move(ranges), replicated_);
}

std::vector<double> MuonLayout::rank_flops() const {
  std::vector<double> f(world(), 0.0);
  for (const auto& m : matrices_) f[m.root] += m.flops;
  return f;
}

double MuonLayout::flop_imbalance() const {
  const auto f = rank_flops();
  const double total = std::accumulate(f.begin(), f.end(), 0.0);
  return total > 0 ? *std::max_element(f.begin(), f.end()) * world() / total : 1.0;
}

}  // namespace rfsdp
