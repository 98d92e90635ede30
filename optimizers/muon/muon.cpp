#include "optimizers/muon/muon.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <numeric>
#include <stdexcept>
#include <tuple>

#include "core/comm/agree.h"
#include "core/ragged/tensor_spec.h"
#include "optimizers/common/adamw_step.h"
#include "optimizers/common/finite.h"
#include "optimizers/common/step_gate.h"
#include "optimizers/common/lpt.h"
#include "optimizers/common/matrices.h"
#include "quant/ops.h"

namespace rfsdp {


MuonAdjustLr parse_muon_adjust_lr(const std::string& s) {
  if (s == "original") return MuonAdjustLr::Original;
  if (s == "match_rms_adamw") return MuonAdjustLr::MatchRmsAdamW;
  throw std::invalid_argument("Muon: adjust_lr must be \"original\" or \"match_rms_adamw\", got \"" +
                              s + "\"");
}

double muon_update_scale(int64_t rows, int64_t cols, MuonAdjustLr adjust) {
  if (adjust == MuonAdjustLr::Original) {
    return std::sqrt(std::max(1.0, static_cast<double>(rows) / static_cast<double>(cols)));
  }
  return 0.2 * std::sqrt(static_cast<double>(std::max(rows, cols)));
}

NsCoefficients NsCoefficients::polar_express() {
  NsCoefficients c;
  c.coefficients = {{8.156554524902461, -22.48329292557795, 15.878769915207462},
                    {4.042929935166739, -2.808917465908714, 0.5000178451051316},
                    {3.8916678022926607, -2.772484153217685, 0.5060648178503393},
                    {3.285753657755655, -2.3681294933425376, 0.46449024233003106},
                    {2.3465413258596377, -1.7097828382687081, 0.42323551169305323}};
  c.norm_scale = 1.02;
  c.eps = 1e-6;
  return c;
}

void NsCoefficients::check_steps(const std::string& who, int steps) const {
  if (coefficients.empty()) throw std::invalid_argument(who + ": ns_coefficients is empty");
  if (coefficients.size() > 1 && steps > static_cast<int>(coefficients.size())) {
    throw std::invalid_argument(who + ": ns_steps=" + std::to_string(steps) + " but ns_coefficients "
                                "has " + std::to_string(coefficients.size()) + " iterations' "
                                "coefficients");
  }
}

at::Tensor newton_schulz_in(const at::Tensor& g, int steps, at::ScalarType dtype,
                            const NsCoefficients& ns) {
  if (g.dim() != 2 && g.dim() != 3) {
    throw std::invalid_argument("newton_schulz: needs a matrix or a batch of matrices");
  }
  ns.check_steps("newton_schulz", steps);
  const bool transposed = g.size(-2) > g.size(-1);
  at::Tensor x = g.to(dtype);
  const bool fresh = !x.is_same(g);  // a new tensor (a cast): normalised in place, as torch does
  if (transposed) x = x.transpose(-2, -1);
  if (g.dim() == 2) {
    const at::Tensor norm = x.norm() * ns.norm_scale + ns.eps;
    x = fresh ? x.div_(norm) : x / norm;
    for (int i = 0; i < steps; ++i) {
      const auto [a, b, c] = ns.at(i);
      const at::Tensor A = at::mm(x, x.t());
      const at::Tensor B = at::addmm(A, A, A, /*beta=*/b, /*alpha=*/c);  // b A + c A A
      x = at::addmm(x, B, x, /*beta=*/a, /*alpha=*/1.0);                // a X + B X
    }
  } else {  // the same, one bmm per product for the whole batch
    x = x / (at::linalg_vector_norm(x, 2, {-2, -1}, /*keepdim=*/true) * ns.norm_scale + ns.eps);
    for (int i = 0; i < steps; ++i) {
      const auto [a, b, c] = ns.at(i);
      const at::Tensor A = at::bmm(x, x.transpose(-2, -1));
      const at::Tensor B = at::baddbmm(A, A, A, /*beta=*/b, /*alpha=*/c);
      x = at::baddbmm(x, B, x, /*beta=*/a, /*alpha=*/1.0);
    }
  }
  return transposed ? x.transpose(-2, -1) : x;
}

at::Tensor newton_schulz(const at::Tensor& g, int steps, at::ScalarType dtype,
                         const NsCoefficients& ns) {
  return newton_schulz_in(g, steps, dtype, ns).to(at::kFloat).contiguous();
}

double newton_schulz_flops(int64_t rows, int64_t cols, int steps) {
  const double n = static_cast<double>(std::min(rows, cols));
  const double N = static_cast<double>(std::max(rows, cols));
  return steps * (4.0 * n * n * N + 2.0 * n * n * n);
}

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
  const int64_t P = static_cast<int64_t>(shards_.size());
  if (static_cast<int64_t>(ns_steps_.size()) != P) {
    throw std::invalid_argument("Muon: " + std::to_string(ns_steps_.size()) +
                                " ns_steps values for " + std::to_string(P) + " parameters");
  }
  if (split_sizes_.empty()) split_sizes_.resize(P);
  if (static_cast<int64_t>(split_sizes_.size()) != P) {
    throw std::invalid_argument("Muon: " + std::to_string(split_sizes_.size()) +
                                " split_sizes values for " + std::to_string(P) + " parameters");
  }
  if (split_dims_.empty()) split_dims_.resize(P, 0);
  if (static_cast<int64_t>(split_dims_.size()) != P) {
    throw std::invalid_argument("Muon: " + std::to_string(split_dims_.size()) +
                                " split_dim values for " + std::to_string(P) + " parameters");
  }
  std::vector<std::vector<OwnerExchange::Range>> ranges(P);
  std::vector<std::string> lines;
  for (int64_t i = 0; i < P; ++i) {
    const TensorShard& p = shards_[i];
    if (p.shape.size() < 2) {
      throw std::invalid_argument(
          "Muon: parameter '" + p.name + "' has shape " + shape_to_string(p.shape) +
          ": Muon orthogonalises matrices (2-D weights, 3-D expert stacks); give 0-D and 1-D "
          "parameters (biases, norm weights) to AdamW (a use_muon=False group)");
    }
    if (ns_steps_[i] < 1) {
      throw std::invalid_argument("Muon: parameter '" + p.name + "': ns_steps must be a positive integer, got " + std::to_string(ns_steps_[i]));
    }
    if (world > 1 && static_cast<int>(p.rank_rows.size()) != world) {
      throw std::invalid_argument("Muon: parameter '" + p.name + "': the layout needs every "
                                  "rank's rows (gather_rank_rows)");
    }
    // Every rank's rows: the ranks only agree that they hold the same parameters
    // and rows (one all-reduce of a hash; the first difference named on every rank).
    auto& split = split_sizes_[i];
    int& dim = split_dims_[i];
    if (!p.blocks.empty()) {  // the plan's logical blocks: the split unless the group gives one
      if (split.empty()) {
        split = p.blocks;
        dim = p.blocks_dim;
      } else if (split != p.blocks || dim != p.blocks_dim) {
        throw std::invalid_argument("Muon: parameter '" + p.name + "': its group's split_sizes " +
                                    shape_to_string(split) + " (split_dim " + std::to_string(dim) +
                                    ") differ from the logical blocks its plan keeps whole, " +
                                    shape_to_string(p.blocks) + " (split_dim " +
                                    std::to_string(p.blocks_dim) +
                                    ", rfsdp.policy.muon(split=...)); give one of them");
      }
    }
    if (!split.empty()) {  // blocks of each matrix's rows (columns), summing to them
      try {
        block_granule_rows(p.name, p.shape, p.shape.size() == 3 ? 2 : 1, split, dim);
      } catch (const std::invalid_argument& e) {  // (the same words as the planner's)
        std::string what = e.what();
        const std::string tensor = "tensor '" + p.name + "': ";
        if (what.rfind(tensor, 0) == 0) what = what.substr(tensor.size());
        throw std::invalid_argument("Muon: parameter '" + p.name + "' of shape " +
                                    shape_to_string(p.shape) + ": split_sizes " +
                                    shape_to_string(split) + " do not fit it: " + what);
      }
    }
    std::string line = p.name + " " + shape_to_string(p.shape) + " ns_steps " +
                       std::to_string(ns_steps_[i]) + " split" + (dim == 1 ? " columns" : "");
    for (int64_t s : split) line += " " + std::to_string(s);
    line += " rows";
    for (const auto& [b, e] : p.rank_rows) {
      line += " [" + std::to_string(b) + ", " + std::to_string(e) + ")";
      ranges[i].emplace_back(b * p.row_len, e * p.row_len);
    }
    if (world == 1) ranges[i] = {{p.row_begin * p.row_len, p.row_end * p.row_len}};
    if (world > 1 && p.rank_rows[rank] != std::make_pair(p.row_begin, p.row_end)) {
      // (a line of its own: every rank then fails in agree_lines, naming it)
      line += "; but rank " + std::to_string(rank) + " holds [" + std::to_string(p.row_begin) +
              ", " + std::to_string(p.row_end) + ")";
    }
    lines.push_back(std::move(line));
  }
  if (comm && world > 1) {
    agree_lines(*comm, lines, "Muon's parameters (build the optimizer from the same model on "
                              "every rank)");
  }
  replicated_.assign(P, false);
  for (int64_t i = 0; i < P; ++i) {
    const auto& rs = ranges[i];
    const int64_t n = shards_[i].full_numel();
    // Every rank holding all of it: replicated (DDP). Else the ranks' shards must
    // tile the tensor: disjoint, together everything.
    replicated_[i] = world > 1 && std::all_of(rs.begin(), rs.end(), [n](const auto& x) {
      return x.first == 0 && x.second == n;
    });
    if (!replicated_[i]) {
      std::vector<std::pair<int64_t, int64_t>> sorted;
      for (const auto& x : rs) {
        if (x.first < x.second) sorted.push_back(x);
      }
      std::sort(sorted.begin(), sorted.end());
      int64_t covered = 0;
      for (const auto& x : sorted) {
        if (x.first != covered) {
          throw std::invalid_argument(
              "Muon: the ranks' shards of '" + shards_[i].name + "' do not tile it (a gap or an "
              "overlap at element " + std::to_string(std::min(x.first, covered)) +
              "); give each rank its own shard (fully_shard's or FSDP2's parameters) or every "
              "rank the whole tensor (replicated: DDP), not a mix; under HSDP, build Muon over "
              "the shard group (its default), not the whole world");
        }
        covered = x.second;
      }
      if (covered != n) {
        throw std::invalid_argument("Muon: the ranks' shards of '" + shards_[i].name +
                                    "' cover " + std::to_string(covered) + " of its " +
                                    std::to_string(n) + " elements");
      }
    }
    for (const MatrixView& m : matrices_of(shards_[i].shape)) {
      if (m.rows * m.cols == 0) continue;
      if (split_dims_[i] == 1) {  // column blocks: the matrix is the unit, split on its root
        MuonMatrix mat;
        mat.param = static_cast<size_t>(i);
        mat.offset = m.offset;
        mat.rows = m.rows;
        mat.cols = m.cols;
        mat.col_blocks = split_sizes_[i];
        for (int64_t c : mat.col_blocks) mat.flops += newton_schulz_flops(m.rows, c, ns_steps_[i]);
        mat.replicated = replicated_[i];
        matrices_.push_back(mat);
        continue;
      }
      const std::vector<int64_t> blocks =
          split_sizes_[i].empty() ? std::vector<int64_t>{m.rows} : split_sizes_[i];
      int64_t row0 = 0;
      for (int64_t rows : blocks) {  // each block its own matrix
        MuonMatrix mat;
        mat.param = static_cast<size_t>(i);
        mat.offset = m.offset + row0 * m.cols;
        mat.rows = rows;
        mat.cols = m.cols;
        mat.flops = newton_schulz_flops(rows, m.cols, ns_steps_[i]);
        mat.replicated = replicated_[i];
        matrices_.push_back(mat);
        row0 += rows;
      }
    }
  }
  // Roots (LPT): a matrix held by one rank stays there; the rest go costliest
  // first to the least-loaded rank, ties to the rank holding most of the matrix.
  std::vector<WorkItem> items(matrices_.size());
  for (size_t k = 0; k < matrices_.size(); ++k) {
    const MuonMatrix& m = matrices_[k];
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
  }
  const std::vector<int> roots = assign_lpt(items, world);
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

namespace {

// Newton–Schulz of the matrices rooted here, in place in `own` ((matrix, update)
// pairs): one matrix at a time, or (batch_same_shape) one batched product chain
// per group of equal shape and steps (expert stacks, layers). Each result must
// be finite: the gate checks them with the gradients' check (one host wait).
// Newton–Schulz of a matrix's column blocks, each alone (batch_same_shape and
// equal widths: one batched product chain), put side by side again.
at::Tensor newton_schulz_by_columns(const at::Tensor& x, const MuonMatrix& m, int steps,
                                    at::ScalarType ns_dtype, const NsCoefficients& ns, bool batch) {
  const auto& w = m.col_blocks;
  if (batch && std::all_of(w.begin(), w.end(), [&](int64_t c) { return c == w[0]; })) {
    const int64_t nb = static_cast<int64_t>(w.size());
    const at::Tensor blocks = x.reshape({m.rows, nb, w[0]}).permute({1, 0, 2});  // [nb, rows, w]
    return newton_schulz_in(blocks, steps, ns_dtype, ns).permute({1, 0, 2}).reshape({m.rows, m.cols});
  }
  std::vector<at::Tensor> parts;
  int64_t c0 = 0;
  for (int64_t c : w) {
    parts.push_back(newton_schulz_in(x.narrow(1, c0, c), steps, ns_dtype, ns));
    c0 += c;
  }
  return at::cat(parts, 1);
}

void orthogonalise(const MuonLayout& layout, std::vector<std::pair<size_t, at::Tensor>>* own,
                   at::ScalarType ns_dtype, const NsCoefficients& ns, bool batch_same_shape,
                   StepGate* gate) {
  const auto& mats = layout.matrices();
  std::map<std::tuple<int64_t, int64_t, int>, std::vector<size_t>> batches;  // -> indices in own
  for (size_t j = 0; j < own->size(); ++j) {
    const MuonMatrix& mat = mats[(*own)[j].first];
    const int steps = layout.ns_steps(mat.param);
    if (!mat.col_blocks.empty()) {
      (*own)[j].second = newton_schulz_by_columns((*own)[j].second, mat, steps, ns_dtype, ns,
                                                  batch_same_shape);
    } else if (batch_same_shape) {
      batches[{mat.rows, mat.cols, steps}].push_back(j);
    } else {
      (*own)[j].second = newton_schulz_in((*own)[j].second, steps, ns_dtype, ns);
    }
  }
  for (const auto& [key, js] : batches) {
    if (js.size() == 1) {  // alone: the plain matrix path
      (*own)[js[0]].second = newton_schulz_in((*own)[js[0]].second, std::get<2>(key), ns_dtype, ns);
      continue;
    }
    std::vector<at::Tensor> batch;
    for (size_t j : js) batch.push_back((*own)[j].second);
    const at::Tensor o = newton_schulz_in(at::stack(batch), std::get<2>(key), ns_dtype, ns);
    for (size_t b = 0; b < js.size(); ++b) (*own)[js[b]].second = o[b];
  }
  std::vector<int> index(mats.size());  // each matrix's index within its parameter
  std::map<size_t, int> seen;
  for (size_t k = 0; k < mats.size(); ++k) index[k] = seen[mats[k].param]++;
  for (const auto& [k, o] : *own) {
    const MuonMatrix& mat = mats[k];
    gate->expect_finite(o, "the Newton-Schulz result of matrix " + std::to_string(index[k]) +
                               " of '" + layout.shards()[mat.param].name + "' (" + std::to_string(mat.rows) +
                               " x " + std::to_string(mat.cols) +
                               ") is not finite: its update holds NaN or Inf, or overflowed "
                               "(check the gradients and the momentum)",
                       /*derived=*/true);
  }
}

}  // namespace

void muon_step_from_updates(Comm* comm, const MuonLayout& layout,
                            const std::vector<at::Tensor>& params, std::vector<at::Tensor>& u,
                            const std::function<void(size_t)>& make_update,
                            const std::vector<MuonHyper>& hyper, at::ScalarType ns_dtype,
                            const NsCoefficients& ns, bool batch_same_shape, StepGate& gate,
                            const std::function<void()>& commit,
                            const std::vector<int64_t>* grad_ranks) {
  at::NoGradGuard no_grad;
  const size_t P = layout.shards().size();
  const auto& mats = layout.matrices();
  const OwnerExchange& ex = layout.exchange();
  Comm* group = comm && layout.world() > 1 ? comm : nullptr;
  const auto direct = [&](size_t k) { return ex.held_whole_here(k) && !mats[k].replicated; };
  // Matrix m's elements in `flat`, a flat tensor of its parameter's rows here (m held whole here).
  const auto region = [&](const MuonMatrix& m, const at::Tensor& flat) {
    const TensorShard& s = layout.shards()[m.param];
    return flat.view(-1).narrow(0, m.offset - s.row_begin * s.row_len, m.rows * m.cols);
  };
  std::vector<std::pair<size_t, at::Tensor>> own;  // (matrix, orthogonalised) rooted here
  // 1. A parameter whose every matrix is held whole here (one process; blocks the
  // plan keeps whole) needs no exchange: its update, then its Newton–Schulz,
  // parameter by parameter, so that each reads what the last just wrote, in
  // cache. (Batched Newton–Schulz wants every update first: the gather path.)
  std::vector<char> ahead(P, 0);
  if (!batch_same_shape) {
    for (size_t k = 0; k < mats.size(); ++k) ahead[mats[k].param] = 1;
    for (size_t k = 0; k < mats.size(); ++k) {
      if (!direct(k)) ahead[mats[k].param] = 0;
    }
  }
  // (one process: a parameter without a gradient is known here already, and skipped
  // before its update and Newton–Schulz; across ranks the gate's count decides)
  const auto skipped_here = [&](size_t i) {
    return group == nullptr && grad_ranks != nullptr && (*grad_ranks)[i] == 0;
  };
  for (size_t i = 0; i < P; ++i) {
    if (!ahead[i] || skipped_here(i)) continue;
    make_update(i);
    if (gate.failed()) continue;
    std::vector<std::pair<size_t, at::Tensor>> mine;
    for (size_t k = 0; k < mats.size(); ++k) {
      if (mats[k].param == i) mine.emplace_back(k, region(mats[k], u[i]).view({mats[k].rows, mats[k].cols}));
    }
    gate.guard([&] { orthogonalise(layout, &mine, ns_dtype, ns, batch_same_shape, &gate); });
    own.insert(own.end(), mine.begin(), mine.end());
    if (!gate.failed()) u[i] = at::Tensor();  // (read by nothing now: memory back for the next)
  }
  // 2. Gather: every other matrix rooted here, whole (one all-to-all).
  for (size_t i = 0; i < P; ++i) {
    if (!ahead[i]) make_update(i);
  }
  std::vector<at::Tensor> flat(P);
  for (size_t i = 0; i < P; ++i) {
    if (!ahead[i]) flat[i] = u[i].view(-1);
  }
  const std::vector<at::Tensor> whole = ex.gather(group, {flat}, /*views=*/true);
  std::vector<std::pair<size_t, at::Tensor>> gathered;
  for (size_t k = 0; k < mats.size(); ++k) {
    if (ex.owns(k) && !ahead[mats[k].param]) {
      gathered.emplace_back(k, whole[k][0].view({mats[k].rows, mats[k].cols}));
    }
  }
  // 3. Newton–Schulz (its failures, and a result that is not finite, agreed by
  // every rank with the caller's checks before anything changes).
  if (!gate.failed()) {
    gate.guard([&] { orthogonalise(layout, &gathered, ns_dtype, ns, batch_same_shape, &gate); });
  }
  own.insert(own.end(), gathered.begin(), gathered.end());
  gate.agree();
  commit();
  // 4. p <- p (1 - lr wd) - (lr scale) o, every matrix by the same arithmetic
  // (torch.optim.Muon's): one held whole here (not replicated) where it lies, o
  // as Newton-Schulz left it (no copies); the others' pieces back through the
  // scatter (one all-to-all), each added with its own matrix's scale.
  // (The decay p *= 1 - lr wd goes region by region just before its add: the
  // matrices tile every parameter, so each element is decayed once, while in cache.)
  const auto decayed = [&](const MuonMatrix& m, at::Tensor region) {
    const MuonHyper& h = hyper[m.param];
    return h.weight_decay != 0.0 ? region.mul_(1.0 - h.lr * h.weight_decay) : region;
  };
  // A matrix of column blocks has each block's scale folded into o on its root
  // (one alpha for the matrix's pieces wherever they go).
  const auto alpha = [&](const MuonMatrix& m) {
    const double scale =
        m.col_blocks.empty() ? muon_update_scale(m.rows, m.cols, hyper[m.param].adjust_lr) : 1.0;
    return -hyper[m.param].lr * scale;
  };
  const auto scaled = [&](const MuonMatrix& m, at::Tensor o_mat) {
    if (m.col_blocks.empty()) return o_mat;
    o_mat = o_mat.to(at::kFloat);
    int64_t c0 = 0;
    for (int64_t c : m.col_blocks) {
      o_mat.narrow(1, c0, c).mul_(muon_update_scale(m.rows, c, hyper[m.param].adjust_lr));
      c0 += c;
    }
    return o_mat;
  };
  const auto skipped = [&](const MuonMatrix& m) {
    return grad_ranks != nullptr && (*grad_ranks)[m.param] == 0;
  };
  std::vector<at::Tensor> results(mats.size()), o(P);
  for (auto& [k, o_mat] : own) {
    const MuonMatrix& mat = mats[k];
    if (!direct(k)) {
      results[k] = scaled(mat, o_mat).to(at::kFloat).reshape(-1);
      continue;
    }
    if (skipped(mat)) continue;
    decayed(mat, region(mat, params[mat.param])).view({mat.rows, mat.cols})
        .add_(scaled(mat, o_mat), alpha(mat));
  }
  for (size_t k = 0; k < mats.size(); ++k) {
    if (!direct(k) && !o[mats[k].param].defined()) o[mats[k].param] = at::empty_like(flat[mats[k].param]);
  }
  ex.scatter(group, results, {o});
  for (size_t k = 0; k < mats.size(); ++k) {  // this rank's rows of each scattered matrix
    const MuonMatrix& mat = mats[k];
    if (direct(k) || skipped(mat)) continue;
    const TensorShard& s = layout.shards()[mat.param];
    const int64_t e0 = s.row_begin * s.row_len, e1 = s.row_end * s.row_len;
    const int64_t b = std::max(mat.offset, e0), e = std::min(mat.offset + mat.rows * mat.cols, e1);
    if (e > b) {
      decayed(mat, params[mat.param].view(-1).narrow(0, b - e0, e - b))
          .add_(o[mat.param].narrow(0, b - e0, e - b), alpha(mat));
    }
  }
}

MuonLayout Muon::layout_of(Comm* comm, std::vector<ParamShard>* params, const MuonOptions& o,
                           std::vector<int> ns_steps, const std::vector<bool>& use_muon,
                           const std::vector<std::vector<int64_t>>& split_sizes,
                           const std::vector<int>& split_dims) {
  const size_t n = params->size();
  if (!ns_steps.empty() && ns_steps.size() != n) {
    throw std::invalid_argument("Muon: " + std::to_string(ns_steps.size()) +
                                " ns_steps values for " + std::to_string(n) + " parameters");
  }
  if (!split_sizes.empty() && split_sizes.size() != n) {
    throw std::invalid_argument("Muon: " + std::to_string(split_sizes.size()) +
                                " split_sizes values for " + std::to_string(n) + " parameters");
  }
  if (!split_dims.empty() && split_dims.size() != n) {
    throw std::invalid_argument("Muon: " + std::to_string(split_dims.size()) +
                                " split_dim values for " + std::to_string(n) + " parameters");
  }
  std::vector<ParamShard> mine;
  std::vector<int> steps, dims;
  std::vector<std::vector<int64_t>> splits;
  for (size_t i = 0; i < n; ++i) {
    if (!use_muon.empty() && !use_muon[i]) continue;
    const ParamShard& p = (*params)[i];
    if (p.shape.empty() && p.full_numel() > 1) {
      throw std::invalid_argument("Muon: parameter '" + p.name + "' has no full shape "
                                  "(ParamShard.shape); use whole_param or param_shards");
    }
    mine.push_back(p);
    steps.push_back(ns_steps.empty() ? o.ns_steps : ns_steps[i]);
    splits.push_back(split_sizes.empty() ? std::vector<int64_t>{} : split_sizes[i]);
    dims.push_back(split_dims.empty() ? 0 : split_dims[i]);
  }
  gather_rank_rows(comm, &mine, "Muon");
  return MuonLayout(comm, std::vector<TensorShard>(mine.begin(), mine.end()), std::move(steps),
                    std::move(splits), std::move(dims));
}

namespace {

std::vector<size_t> muon_indices(size_t n, const std::vector<bool>& use_muon) {
  if (!use_muon.empty() && use_muon.size() != n) {
    throw std::invalid_argument("Muon: " + std::to_string(use_muon.size()) + " use_muon flags for " +
                                std::to_string(n) + " parameters");
  }
  std::vector<size_t> out;
  for (size_t i = 0; i < n; ++i) {
    if (use_muon.empty() || use_muon[i]) out.push_back(i);
  }
  return out;
}

}  // namespace

void check_config(const MuonOptions& o) {
  if (o.ns_dtype != at::kFloat && o.ns_dtype != at::kBFloat16) {
    throw std::invalid_argument("Muon: ns_dtype must be torch.float32 or torch.bfloat16");
  }
  const at::ScalarType md = o.momentum_dtype;
  if (md != at::kFloat && md != at::kBFloat16 && md != at::kByte) {
    throw std::invalid_argument("Muon: momentum_dtype must be torch.float32, torch.bfloat16 or "
                                "\"int8\" (8-bit block-wise codes)");
  }
  if (o.momentum_map != "dynamic" && o.momentum_map != "linear") {
    throw std::invalid_argument("Muon: momentum_map must be \"dynamic\" or \"linear\", got \"" +
                                o.momentum_map + "\"");
  }
  if (o.momentum_block < 1) {
    throw std::invalid_argument("Muon: momentum_block must be a positive integer, got " +
                                std::to_string(o.momentum_block));
  }
  if (o.ns_steps < 1) {
    throw std::invalid_argument("Muon: ns_steps must be a positive integer, got " +
                                std::to_string(o.ns_steps));
  }
}

Muon::Muon(std::shared_ptr<Comm> comm, std::vector<ParamShard> params, MuonOptions options,
           std::vector<int> ns_steps, std::vector<bool> use_muon,
           std::vector<std::vector<int64_t>> split_sizes, std::vector<int> split_dims)
    : GroupedOptimizer("Muon", std::move(params), std::move(comm), options.check_finite,
                       options.hyper),
      options_(options),
      muon_(muon_indices(params_.size(), use_muon)),
      layout_(layout_of(comm_.get(), &params_, options, std::move(ns_steps), use_muon, split_sizes,
                        split_dims)) {
  check_options(options.hyper);
  check_config(options_);
  for (size_t k = 0; k < layout_.shards().size(); ++k) {
    options_.ns_coefficients.check_steps("Muon: parameter '" + layout_.shards()[k].name + "'",
                                         layout_.ns_steps(k));
  }
  if (eight_bit()) code_ = quant::Codec(quant::code_map(options_.momentum_map, /*is_signed=*/true));
  const size_t P = params_.size();
  in_muon_.assign(P, -1);
  for (size_t k = 0; k < muon_.size(); ++k) in_muon_[muon_[k]] = static_cast<int64_t>(k);
  momenta_.resize(P);
  absmax_.resize(P);
  exp_avg_.resize(P);
  exp_avg_sq_.resize(P);
  for (size_t i = 0; i < P; ++i) {
    const ParamShard& p = params_[i];
    if (!uses_muon(i)) {  // AdamW's moments
      exp_avg_[i] = at::zeros(p.param.sizes(), state_options(i));
      exp_avg_sq_[i] = at::zeros(p.param.sizes(), state_options(i));
      continue;
    }
    if (!eight_bit()) {
      momenta_[i] = at::zeros(p.param.sizes(), p.param.options().dtype(options_.momentum_dtype));
      continue;
    }
    quant::check_whole_blocks(quant::BlockShape::blocks(options_.momentum_block), p.name,
                              p.full_rows, p.row_len, p.row_begin, p.rows());
    // zero codes decode to the map's value nearest 0: store its code
    momenta_[i] = at::full(p.param.sizes(), code_.lut().nearest(0.0f), p.param.options().dtype(at::kByte));
    absmax_[i] = at::zeros({block_layout(i).num_blocks}, p.param.options().dtype(at::kFloat));
  }
}

void Muon::clear_state(size_t i) {
  if (!uses_muon(i)) {
    exp_avg_[i].zero_();
    exp_avg_sq_[i].zero_();
  } else if (!eight_bit()) {
    momenta_[i].zero_();
  } else {  // zero codes decode to the map's value nearest 0
    momenta_[i].fill_(code_.lut().nearest(0.0f));
    absmax_[i].zero_();
  }
}

quant::BlockLayout Muon::block_layout(size_t i) const {
  // The shard starts on a block edge (checked), so its blocks are the global tensor's.
  return quant::BlockLayout(quant::BlockShape::blocks(options_.momentum_block), 1,
                            params_.at(i).param.numel());
}

at::Tensor Muon::momentum(size_t i) const {
  if (!uses_muon(i)) {
    throw std::invalid_argument("Muon: parameter '" + params_.at(i).name + "' takes AdamW "
                                "(use_muon false): it has no momentum buffer");
  }
  if (!eight_bit()) return momenta_.at(i).to(at::kFloat);
  at::Tensor out = at::empty(momenta_.at(i).sizes(), absmax_.at(i).options());
  quant::dequantize(momenta_[i].view(-1), absmax_[i], block_layout(i), code_, out.view(-1));
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> Muon::state(size_t i) const {
  if (!uses_muon(i)) return {{"exp_avg", exp_avg_[i]}, {"exp_avg_sq", exp_avg_sq_[i]}};
  if (!eight_bit()) return {{"momentum_buffer", momenta_.at(i)}};
  return {{"momentum_codes", momenta_.at(i)}, {"momentum_absmax", absmax_.at(i)}};
}

NamedState Muon::requantized_state(size_t i, const MuonOptions& saved_options,
                                   const NamedState& full) const {
  if (!uses_muon(i)) return saved_as_kept(i, full, {"exp_avg", "exp_avg_sq"});
  const ParamShard& p = params_.at(i);
  NamedState out;
  at::Tensor whole;  // the flattened global tensor's momentum, fp32
  if (full.count("momentum_codes")) {
    whole = quant::dequantize_blockwise(
        {saved(full, "momentum_codes", name(), p).reshape(-1),
         saved(full, "momentum_absmax", name(), p).reshape(-1)},
        quant::code_map(saved_options.momentum_map, true),
        quant::BlockShape::blocks(saved_options.momentum_block));
  } else {
    whole = saved(full, "momentum_buffer", name(), p).reshape(-1).to(at::kFloat);
  }
  if (!eight_bit()) {
    out["momentum_buffer"] = rows_here(p, whole).view(p.param.sizes()).to(momenta_.at(i).dtype());
    return out;
  }
  const int64_t block = options_.momentum_block;
  const quant::Quantized q = quant::quantize_blockwise(
      whole.contiguous(), quant::code_map(options_.momentum_map, true), quant::BlockShape::blocks(block));
  out["momentum_codes"] = rows_here(p, q.codes).view(p.param.sizes());
  out["momentum_absmax"] = q.absmax.reshape(-1)
                               .narrow(0, p.row_begin * p.row_len / block, absmax_.at(i).numel())
                               .clone();
  return out;
}

std::vector<StateLayout> Muon::state_layout(size_t i) const {
  if (!uses_muon(i)) return {StateLayout::rows("exp_avg"), StateLayout::rows("exp_avg_sq")};
  if (!eight_bit()) return {StateLayout::rows("momentum_buffer")};
  // Blocks of the flattened global tensor; the shard starts on a block edge (checked).
  const ParamShard& p = params_.at(i);
  const int64_t block = options_.momentum_block;
  return {StateLayout::rows("momentum_codes"),
          StateLayout::sequence("momentum_absmax", (p.full_numel() + block - 1) / block,
                                p.row_begin * p.row_len / block)};
}

void Muon::check_options(const MuonHyper& h) const {
  check_option("Muon", "lr", h.lr, h.lr >= 0, ">= 0");
  check_option("Muon", "momentum", h.momentum, h.momentum >= 0 && h.momentum < 1, "in [0, 1)");
  check_option("Muon", "weight_decay", h.weight_decay, h.weight_decay >= 0, ">= 0");
  const std::string adam = "Muon: the AdamW part (use_muon=False groups)";
  check_option(adam, "betas[0]", h.adam_beta1, h.adam_beta1 >= 0 && h.adam_beta1 < 1, "in [0, 1)");
  check_option(adam, "betas[1]", h.adam_beta2, h.adam_beta2 >= 0 && h.adam_beta2 < 1, "in [0, 1)");
  check_option(adam, "eps", h.adam_eps, h.adam_eps > 0, "> 0");
}

void Muon::check_replicated_grads(const std::vector<at::Tensor>& grads) const {
  std::vector<size_t> rep;  // layout indices
  for (size_t k = 0; k < muon_.size(); ++k) {
    if (layout_.replicated(k)) rep.push_back(k);
  }
  if (rep.empty() || !comm_ || comm_->size() == 1) return;
  // Per parameter the sum and the sum of squares (float64), and their negations:
  // one max all-reduce gives every rank the largest and the smallest of each.
  std::vector<at::Tensor> parts;
  for (size_t i : rep) {
    const at::Tensor g = grads[i].to(at::kDouble);
    parts.push_back(g.sum().view({1}));
    parts.push_back(g.square().sum().view({1}));
  }
  at::Tensor sums = at::cat(parts);
  at::Tensor both = at::cat({sums, -sums}).to(comm_->control_device());
  comm_->all_reduce(both, ReduceOp::Max).wait();
  both = both.cpu();
  const int64_t n = sums.numel();
  const double* b = both.data_ptr<double>();
  for (int64_t k = 0; k < n; ++k) {
    const double hi = b[k], lo = -b[n + k];
    // (the ranks may sum in another order: a relative 1e-6 is rounding, not another gradient)
    if (hi - lo > 1e-6 * std::max(std::fabs(hi), std::fabs(lo)) + 1e-30) {
      throw std::invalid_argument(
          "parameter '" + params_[muon_[rep[k / 2]]].name + "' is replicated (every rank "
          "holds it whole) but its gradients differ between the ranks (their " +
          (k % 2 ? "sums of squares" : "sums") + " range from " + std::to_string(lo) + " to " +
          std::to_string(hi) + "); replicated parameters need equal gradients, as "
          "DistributedDataParallel gives them (all-reduce them first), or shard the model "
          "(fully_shard or FSDP2). Nothing was changed");
    }
  }
}

bool Muon::checks_own_gradient(size_t i) const {
  return uses_muon(i) && params_[i].grad.defined() && params_[i].grad.device().is_cpu();
}

void Muon::run_step(StepGate& gate, const std::vector<size_t>& stepping) {
  at::NoGradGuard no_grad;
  const size_t M = muon_.size();
  std::vector<at::Tensor> ps(M), gs(M);
  std::vector<MuonHyper> hyper(M);
  // How many ranks have each parameter's gradient (summed in the gate's
  // all-reduce): a rank without one takes part with zeros; a parameter no rank
  // has one for is skipped, as torch skips a parameter without a gradient.
  std::vector<int64_t> grad_ranks(M, 0);
  for (size_t k = 0; k < M; ++k) {
    const size_t i = muon_[k];
    ps[k] = params_[i].param;
    gs[k] = params_[i].grad;
    hyper[k] = options_of(i);
    grad_ranks[k] = gs[k].defined() ? 1 : 0;
    if (!gs[k].defined()) gs[k] = at::zeros(ps[k].sizes(), state_options(i));
  }
  gate.share_counts(&grad_ranks);
  // (collective: every rank checks, a failed one too, and all fail alike)
  gate.guard([&] { check_replicated_grads(gs); });
  const bool on_gpu = !ps.empty() && ps[0].is_cuda();
  const bool batch = options_.batch_newton_schulz.value_or(on_gpu);
  // The new momentum and the update in fp32 (made when the step needs them); the
  // momentum stored on commit.
  std::vector<at::Tensor> u(M), pending(M), pending_absmax(M);
  const auto make_update_of = [&](size_t k) {
    const size_t i = muon_[k];
    const at::Tensor g = gs[k].contiguous().view(-1);
    const double beta = hyper[k].momentum;
    if (momenta_[i].scalar_type() == at::kFloat) {
      // torch.optim.Muon's lerps, bit for bit, with one new tensor (as torch's): the new
      // momentum in u, then (Nesterov) g.lerp(it, beta) over it in place; the stored
      // momentum takes the same lerp in place on commit, after every check has passed.
      u[k] = momenta_[i].view(-1).lerp(g, 1.0 - beta);
      if (hyper[k].nesterov) at::lerp_out(u[k], g, u[k], beta);
      return;
    }
    if (!eight_bit()) {  // bf16: torch's lerp in fp32, stored rounded on commit
      pending[k] = momenta_[i].view(-1).to(at::kFloat).lerp(g, 1.0 - beta);
      u[k] = hyper[k].nesterov ? g.lerp(pending[k], beta) : pending[k];
      return;
    }
    pending[k] = at::empty_like(momenta_[i]);
    pending_absmax[k] = at::empty_like(absmax_[i]);
    u[k] = at::empty({g.numel()}, g.options().dtype(at::kFloat));
    quant::momentum8bit_step(g.to(at::kFloat), momenta_[i].view(-1), absmax_[i], block_layout(i),
                             code_, static_cast<float>(beta), hyper[k].nesterov,
                             pending[k].view(-1), pending_absmax[k], u[k]);
  };
  const auto make_update = [&](size_t k) {
    make_update_of(k);
    // The gradient's NaN/Inf check (checks_own_gradient): u is finite exactly when the
    // gradient is and the momentum did not overflow; u is read while in cache, the
    // gradient only to name the cause.
    const size_t i = muon_[k];
    if (check_finite_ && checks_own_gradient(i) && !gate.failed() && !tensor_finite(u[k])) {
      gate.check_finite(params_[i].name, gs[k]);
      gate.expect_finite(u[k], "the momentum of parameter '" + params_[i].name + "' overflowed "
                               "(its update holds NaN or Inf though its gradient is finite)");
    }
  };
  // (A momentum that overflowed makes u, and so Newton–Schulz's result, non-finite:
  // that failure is agreed with the gradients' in the step below, in one all-reduce.)
  muon_step_from_updates(comm_.get(), layout_, ps, u, make_update, hyper, options_.ns_dtype,
                         options_.ns_coefficients, batch, gate, [&] {
    for (size_t k = 0; k < M; ++k) {
      const size_t i = muon_[k];
      if (grad_ranks[k] == 0) continue;  // no rank had its gradient: unchanged
      if (!pending[k].defined()) {
        momenta_[i].view(-1).lerp_(gs[k].contiguous().view(-1), 1.0 - hyper[k].momentum);
        continue;
      }
      momenta_[i].view(-1).copy_(pending[k].view(-1));
      if (eight_bit()) absmax_[i].copy_(pending_absmax[k]);
    }
  }, &grad_ranks);
  // The AdamW part: the parameters outside Muon that have a gradient.
  std::vector<AdamWStep> adam;
  for (size_t i : stepping) {
    if (uses_muon(i)) continue;
    const MuonHyper& h = options_of(i);
    adam.push_back({params_[i].param, params_[i].grad, exp_avg_[i], exp_avg_sq_[i], h.lr,
                    h.adam_beta1, h.adam_beta2, h.adam_eps, h.weight_decay, param_steps_[i],
                    group_of_[i]});
  }
  fused_launches_ += adamw_fp32_steps(adam, /*fused_on_cpu=*/false);
}

}  // namespace rfsdp
