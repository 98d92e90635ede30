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
#include "optimizers/common/step_gate.h"
#include "optimizers/common/lpt.h"
#include "optimizers/common/matrices.h"
#include "quant/blockwise/code_maps.h"
#include "quant/blockwise/cpu_kernels.h"

namespace rfsdp {

namespace {

int64_t numel_of(const std::vector<int64_t>& s) {
  return std::accumulate(s.begin(), s.end(), int64_t{1}, std::multiplies<int64_t>());
}

// The matrices of one parameter: (offset, rows, cols).
// Order-sensitive fingerprint of the parameter list (shapes, Newton–Schulz
// steps), so ranks passing different lists fail with a clear error.
int64_t fingerprint(const std::vector<MuonParamGeometry>& params) {
  uint64_t h = 1469598103934665603ULL;
  auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ULL; };
  for (const auto& p : params) {
    mix(p.shape.size());
    for (int64_t d : p.shape) mix(static_cast<uint64_t>(d));
    mix(static_cast<uint64_t>(p.ns_steps));
  }
  return static_cast<int64_t>(h >> 2);  // non-negative; sums of one non-zero row stay exact
}

}  // namespace

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

at::Tensor newton_schulz(const at::Tensor& g, int steps, at::ScalarType dtype) {
  if (g.dim() != 2 && g.dim() != 3) {
    throw std::invalid_argument("newton_schulz: needs a matrix or a batch of matrices");
  }
  constexpr double a = 3.4445, b = -4.7750, c = 2.0315;
  const bool transposed = g.size(-2) > g.size(-1);
  at::Tensor x = g.to(dtype);
  if (transposed) x = x.transpose(-2, -1);
  if (g.dim() == 2) {
    x = x / (x.norm() + 1e-7);
    for (int i = 0; i < steps; ++i) {
      const at::Tensor A = at::mm(x, x.t());
      const at::Tensor B = at::addmm(A, A, A, /*beta=*/b, /*alpha=*/c);  // b A + c A A
      x = at::addmm(x, B, x, /*beta=*/a, /*alpha=*/1.0);                // a X + B X
    }
  } else {  // the same, one bmm per product for the whole batch
    x = x / (at::linalg_vector_norm(x, 2, {-2, -1}, /*keepdim=*/true) + 1e-7);
    for (int i = 0; i < steps; ++i) {
      const at::Tensor A = at::bmm(x, x.transpose(-2, -1));
      const at::Tensor B = at::baddbmm(A, A, A, /*beta=*/b, /*alpha=*/c);
      x = at::baddbmm(x, B, x, /*beta=*/a, /*alpha=*/1.0);
    }
  }
  if (transposed) x = x.transpose(-2, -1);
  return x.to(at::kFloat).contiguous();
}

double newton_schulz_flops(int64_t rows, int64_t cols, int steps) {
  const double n = static_cast<double>(std::min(rows, cols));
  const double N = static_cast<double>(std::max(rows, cols));
  return steps * (4.0 * n * n * N + 2.0 * n * n * n);
}

int64_t MuonLayout::total(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

MuonLayout::MuonLayout(Comm* comm, std::vector<MuonParamGeometry> params)
    : params_(std::move(params)) {
  world_ = comm ? comm->size() : 1;
  rank_ = comm ? comm->rank() : 0;
  const int64_t P = static_cast<int64_t>(params_.size());
  for (const auto& p : params_) {
    if (p.shape.size() < 2) {
      throw std::invalid_argument(
          "Muon: parameter '" + p.name + "' has shape " + shape_to_string(p.shape) +
          ": Muon orthogonalises matrices (2-D weights, 3-D expert stacks); give 0-D and 1-D "
          "parameters (biases, norm weights) to AdamW (a use_muon=False group)");
    }
    if (p.ns_steps < 1) {
      throw std::invalid_argument("Muon: parameter '" + p.name + "': ns_steps must be >= 1");
    }
    if (p.elem_begin < 0 || p.elem_begin > p.elem_end || p.elem_end > numel_of(p.shape)) {
      throw std::invalid_argument("Muon: parameter '" + p.name + "': shard range [" +
                                  std::to_string(p.elem_begin) + ", " + std::to_string(p.elem_end) +
                                  ") is not inside its " + std::to_string(numel_of(p.shape)) +
                                  " elements");
    }
  }
  ranges_.assign(P, {});
  const bool known = std::all_of(params_.begin(), params_.end(), [&](const MuonParamGeometry& p) {
    return static_cast<int>(p.rank_elems.size()) == world_;
  });
  if (known) {
    // Every rank's ranges came with the shards (the plan): the ranks only agree
    // that they hold the same parameters and ranges (one all-reduce of a hash;
    // the first difference named on every rank).
    std::vector<std::string> lines;
    for (int64_t i = 0; i < P; ++i) {
      const auto& p = params_[i];
      std::string line = p.name + " " + shape_to_string(p.shape) + " ns_steps " +
                         std::to_string(p.ns_steps) + " elements";
      for (const auto& [b, e] : p.rank_elems) line += " [" + std::to_string(b) + ", " + std::to_string(e) + ")";
      if (p.rank_elems[rank_] != std::make_pair(p.elem_begin, p.elem_end)) {
        // (a line of its own: every rank then fails in agree_lines, naming it)
        line += "; but rank " + std::to_string(rank_) + " holds [" + std::to_string(p.elem_begin) +
                ", " + std::to_string(p.elem_end) + ")";
      }
      lines.push_back(std::move(line));
      ranges_[i] = p.rank_elems;
    }
    if (comm && world_ > 1) {
      agree_lines(*comm, lines, "Muon's parameters (build the optimizer from the same model on "
                                "every rank)");
    }
  } else {
    // Every rank's ranges: one all-reduce of a table where each rank fills its row.
    at::Tensor table = at::zeros({world_, 2 + 2 * P}, at::kLong);
    auto t = table.accessor<int64_t, 2>();
    t[rank_][0] = P;
    t[rank_][1] = fingerprint(params_);
    for (int64_t i = 0; i < P; ++i) {
      t[rank_][2 + 2 * i] = params_[i].elem_begin;
      t[rank_][3 + 2 * i] = params_[i].elem_end;
    }
    if (comm && world_ > 1) {
      at::Tensor shared = table.to(comm->control_device());  // NCCL takes no CPU tensors
      comm->all_reduce(shared, ReduceOp::Sum).wait();
      table.copy_(shared.cpu());
    }
    for (int r = 0; r < world_; ++r) {
      if (t[r][0] != P || t[r][1] != t[rank_][1]) {
        throw std::invalid_argument(
            "Muon: rank " + std::to_string(r) + " passed a different parameter list (count " +
            std::to_string(t[r][0]) + " vs " + std::to_string(P) + " here, or other shapes) than " +
            "rank " + std::to_string(rank_) + "; build the optimizer from the same model on every rank");
      }
    }
    for (int64_t i = 0; i < P; ++i) {
      for (int r = 0; r < world_; ++r) ranges_[i].emplace_back(t[r][2 + 2 * i], t[r][3 + 2 * i]);
    }
  }
  replicated_.assign(P, false);
  for (int64_t i = 0; i < P; ++i) {
    const auto& rs = ranges_[i];
    const int64_t n = numel_of(params_[i].shape);
    // Every rank holding all of it: replicated (DDP). Else the ranks' shards must
    // tile the tensor: disjoint, together everything.
    replicated_[i] = world_ > 1 && std::all_of(rs.begin(), rs.end(), [n](const auto& x) {
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
              "Muon: the ranks' shards of '" + params_[i].name + "' do not tile it (a gap or an "
              "overlap at element " + std::to_string(std::min(x.first, covered)) +
              "); give each rank its own shard (fully_shard's or FSDP2's parameters) or every "
              "rank the whole tensor (replicated: DDP), not a mix; under HSDP, build Muon over "
              "the shard group (its default), not the whole world");
        }
        covered = x.second;
      }
      if (covered != n) {
        throw std::invalid_argument("Muon: the ranks' shards of '" + params_[i].name +
                                    "' cover " + std::to_string(covered) + " of its " +
                                    std::to_string(n) + " elements");
      }
    }
    for (const MatrixView& m : matrices_of(params_[i].shape)) {
      if (m.rows * m.cols == 0) continue;
      MuonMatrix mat;
      mat.param = static_cast<size_t>(i);
      mat.offset = m.offset;
      mat.rows = m.rows;
      mat.cols = m.cols;
      mat.flops = newton_schulz_flops(m.rows, m.cols, params_[i].ns_steps);
      mat.replicated = replicated_[i];
      matrices_.push_back(mat);
    }
  }
  // Roots (LPT): a matrix held by one rank stays there; the rest go costliest
  // first to the least-loaded rank, ties to the rank holding most of the matrix.
  std::vector<WorkItem> items(matrices_.size());
  for (size_t k = 0; k < matrices_.size(); ++k) {
    items[k].cost = matrices_[k].flops;
    items[k].affinity.assign(world_, 0);
    int holders = 0, holder = 0;
    for (int r = 0; r < world_; ++r) {
      const auto pc = piece(k, r);
      items[k].affinity[r] = pc.second - pc.first;
      if (pc.first < pc.second) ++holders, holder = r;
    }
    if (holders == 1) items[k].fixed_rank = holder;
  }
  const std::vector<int> roots = assign_lpt(items, world_);
  for (size_t k = 0; k < matrices_.size(); ++k) matrices_[k].root = roots[k];
  send_splits_.assign(world_, 0);
  recv_splits_.assign(world_, 0);
  scatter_send_splits_.assign(world_, 0);
  scatter_recv_splits_.assign(world_, 0);
  auto size = [](std::pair<int64_t, int64_t> pc) { return pc.second - pc.first; };
  for (size_t k = 0; k < matrices_.size(); ++k) {
    const int root = matrices_[k].root;
    if (root != rank_) {
      send_splits_[root] += size(gather_piece(k, rank_));
      scatter_recv_splits_[root] += size(piece(k, rank_));
    } else {
      for (int s = 0; s < world_; ++s) {
        if (s == rank_) continue;
        recv_splits_[s] += size(gather_piece(k, s));
        scatter_send_splits_[s] += size(piece(k, s));
      }
    }
  }
}

std::pair<int64_t, int64_t> MuonLayout::gather_piece(size_t k, int r) const {
  const MuonMatrix& m = matrices_.at(k);
  if (m.replicated && r != m.root) return {m.offset, m.offset};
  return piece(k, r);
}

std::pair<int64_t, int64_t> MuonLayout::piece(size_t k, int r) const {
  const MuonMatrix& m = matrices_.at(k);
  const auto& range = ranges_[m.param][r];
  const int64_t b = std::max(m.offset, range.first);
  const int64_t e = std::min(m.offset + m.rows * m.cols, range.second);
  return b < e ? std::make_pair(b, e) : std::make_pair(b, b);
}

std::vector<double> MuonLayout::rank_flops() const {
  std::vector<double> f(world_, 0.0);
  for (const auto& m : matrices_) f[m.root] += m.flops;
  return f;
}

double MuonLayout::flop_imbalance() const {
  const auto f = rank_flops();
  const double total = std::accumulate(f.begin(), f.end(), 0.0);
  return total > 0 ? *std::max_element(f.begin(), f.end()) * world_ / total : 1.0;
}

namespace {

// Newton–Schulz of the matrices rooted here, in place in `own` ((matrix, update)
// pairs): one matrix at a time, or (batch_same_shape) one batched product chain
// per group of equal shape and steps (expert stacks, layers). Each result must
// be finite: the gate checks them with the gradients' check (one host wait).
void orthogonalise(const MuonLayout& layout, std::vector<std::pair<size_t, at::Tensor>>* own,
                   at::ScalarType ns_dtype, bool batch_same_shape, StepGate* gate) {
  const auto& mats = layout.matrices();
  const auto& geo = layout.params();
  std::map<std::tuple<int64_t, int64_t, int>, std::vector<size_t>> batches;  // -> indices in own
  for (size_t j = 0; j < own->size(); ++j) {
    const MuonMatrix& mat = mats[(*own)[j].first];
    const int steps = geo[mat.param].ns_steps;
    if (batch_same_shape) {
      batches[{mat.rows, mat.cols, steps}].push_back(j);
    } else {
      (*own)[j].second = newton_schulz((*own)[j].second, steps, ns_dtype);
    }
  }
  for (const auto& [key, js] : batches) {
    if (js.size() == 1) {  // alone: the plain matrix path
      (*own)[js[0]].second = newton_schulz((*own)[js[0]].second, std::get<2>(key), ns_dtype);
      continue;
    }
    std::vector<at::Tensor> batch;
    for (size_t j : js) batch.push_back((*own)[j].second);
    const at::Tensor o = newton_schulz(at::stack(batch), std::get<2>(key), ns_dtype);
    for (size_t b = 0; b < js.size(); ++b) (*own)[js[b]].second = o[b];
  }
  std::vector<int> index(mats.size());  // each matrix's index within its parameter
  std::map<size_t, int> seen;
  for (size_t k = 0; k < mats.size(); ++k) index[k] = seen[mats[k].param]++;
  for (const auto& [k, o] : *own) {
    const MuonMatrix& mat = mats[k];
    gate->expect_finite(o, "the Newton-Schulz result of matrix " + std::to_string(index[k]) +
                               " of '" + geo[mat.param].name + "' (" + std::to_string(mat.rows) +
                               " x " + std::to_string(mat.cols) +
                               ") is not finite: its update holds NaN or Inf, or overflowed "
                               "(check the gradients and the momentum)");
  }
}

}  // namespace

void muon_step(Comm* comm, const MuonLayout& layout, const std::vector<at::Tensor>& params,
               const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& momenta,
               const std::vector<MuonHyper>& hyper, at::ScalarType ns_dtype,
               bool batch_same_shape) {
  const auto& geo = layout.params();
  const size_t P = geo.size();
  if (params.size() != P || grads.size() != P || momenta.size() != P || hyper.size() != P) {
    throw std::invalid_argument("muon_step: need one param, grad, momentum and hyper per layout "
                                "parameter (" + std::to_string(P) + ")");
  }
  for (size_t i = 0; i < P; ++i) {
    const int64_t n = geo[i].elem_end - geo[i].elem_begin;
    for (const at::Tensor* t : {&params[i], &grads[i], &momenta[i]}) {
      if (t->scalar_type() != at::kFloat || !t->is_contiguous() || t->numel() != n ||
          t->device() != params[0].device()) {
        throw std::invalid_argument("muon_step: parameter '" + geo[i].name + "': param, grad and "
                                    "momentum must be contiguous float32 of its shard's " +
                                    std::to_string(n) + " elements, all on one device");
      }
    }
  }
  at::NoGradGuard no_grad;
  // 1. Momentum and the update to orthogonalise, on the local shard. The new
  // momentum is kept aside: it is stored only once every rank's roots succeeded.
  std::vector<at::Tensor> new_momenta(P), u(P);
  for (size_t i = 0; i < P; ++i) {
    const at::Tensor g = grads[i].view(-1);
    new_momenta[i] = momenta[i].view(-1).lerp(g, 1.0 - hyper[i].momentum);
    u[i] = hyper[i].nesterov ? g.lerp(new_momenta[i], hyper[i].momentum) : new_momenta[i];
  }
  muon_step_from_updates(comm, layout, params, u, hyper, ns_dtype, batch_same_shape, [&] {
    for (size_t i = 0; i < P; ++i) momenta[i].view(-1).copy_(new_momenta[i]);
  });
}

void muon_step_from_updates(Comm* comm, const MuonLayout& layout,
                            const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& u,
                            const std::vector<MuonHyper>& hyper, at::ScalarType ns_dtype,
                            bool batch_same_shape, const std::function<void()>& commit) {
  at::NoGradGuard no_grad;
  const auto& geo = layout.params();
  const size_t P = geo.size();
  const int me = layout.rank(), world = layout.world();
  const auto& mats = layout.matrices();
  auto local = [&](const at::Tensor& flat, size_t k, std::pair<int64_t, int64_t> pc) {
    return flat.narrow(0, pc.first - geo[mats[k].param].elem_begin, pc.second - pc.first);
  };
  auto offsets_of = [world](const std::vector<int64_t>& splits) {
    std::vector<int64_t> off(world, 0);
    for (int r = 1; r < world; ++r) off[r] = off[r - 1] + splits[r - 1];
    return off;
  };
  const auto& send_splits = layout.send_splits();
  const auto& recv_splits = layout.recv_splits();
  // 2. Gather: to each root, this rank's pieces of its matrices (by root, then matrix).
  // Buffers live where the shards do (NCCL needs them on the GPU).
  const at::TensorOptions opts = P ? params[0].options() : at::TensorOptions(at::kFloat);
  at::Tensor send = at::empty({layout.gather_send_elems()}, opts);
  at::Tensor recv = at::empty({layout.gather_recv_elems()}, opts);
  {
    auto pos = offsets_of(send_splits);
    for (size_t k = 0; k < mats.size(); ++k) {
      if (mats[k].root == me) continue;
      const auto pc = layout.gather_piece(k, me);
      if (pc.first == pc.second) continue;
      send.narrow(0, pos[mats[k].root], pc.second - pc.first).copy_(local(u[mats[k].param], k, pc));
      pos[mats[k].root] += pc.second - pc.first;
    }
  }
  if (comm && world > 1) comm->all_to_all(recv, send, recv_splits, send_splits).wait();
  // 3. Newton–Schulz on this rank's roots; 4. scatter the pieces back.
  const auto& back_send_splits = layout.scatter_send_splits();
  const auto& back_recv_splits = layout.scatter_recv_splits();
  at::Tensor back_send = at::empty({layout.scatter_send_elems()}, opts);
  at::Tensor back_recv = at::empty({layout.scatter_recv_elems()}, opts);
  std::vector<std::pair<size_t, at::Tensor>> own;  // (matrix, orthogonalised) rooted here
  {
    // Each matrix rooted here, whole: this rank's piece and the received ones.
    auto from = offsets_of(recv_splits);
    for (size_t k = 0; k < mats.size(); ++k) {
      const MuonMatrix& mat = mats[k];
      if (mat.root != me) continue;
      at::Tensor full = at::empty({mat.rows * mat.cols}, opts);
      for (int s = 0; s < world; ++s) {
        const auto pc = layout.gather_piece(k, s);  // (the root's own piece: all of it if replicated)
        const int64_t n = pc.second - pc.first;
        if (n == 0) continue;
        at::Tensor dst = full.narrow(0, pc.first - mat.offset, n);
        if (s == me) {
          dst.copy_(local(u[mat.param], k, pc));
        } else {
          dst.copy_(recv.narrow(0, from[s], n));
          from[s] += n;
        }
      }
      own.emplace_back(k, full.view({mat.rows, mat.cols}));
    }
    // Newton–Schulz (its failures, and a result that is not finite, agreed by
    // every rank before anything changes).
    StepGate gate(comm, "Muon step");
    gate.guard([&] { orthogonalise(layout, &own, ns_dtype, batch_same_shape, &gate); });
    gate.agree();
    commit();
    auto to = offsets_of(back_send_splits);
    for (auto& [k, o_mat] : own) {
      const MuonMatrix& mat = mats[k];
      at::Tensor o = o_mat.reshape(-1);
      o.mul_(muon_update_scale(mat.rows, mat.cols, hyper[mat.param].adjust_lr));
      o_mat = o;
      for (int s = 0; s < world; ++s) {
        const auto pc = layout.piece(k, s);
        const int64_t n = pc.second - pc.first;
        if (n == 0 || s == me) continue;
        back_send.narrow(0, to[s], n).copy_(o.narrow(0, pc.first - mat.offset, n));
        to[s] += n;
      }
    }
  }
  if (comm && world > 1) {
    comm->all_to_all(back_recv, back_send, back_recv_splits, back_send_splits).wait();
  }
  // 5. p <- p (1 - lr wd) - lr o, piece by piece (the pieces tile the shard).
  auto apply = [&](size_t k, std::pair<int64_t, int64_t> pc, const at::Tensor& o_piece) {
    const MuonHyper& h = hyper[mats[k].param];
    at::Tensor p = local(params[mats[k].param].view(-1), k, pc);
    if (h.weight_decay != 0.0) p.mul_(1.0 - h.lr * h.weight_decay);
    p.add_(o_piece, -h.lr);
  };
  for (const auto& [k, o] : own) {
    const auto pc = layout.piece(k, me);
    if (pc.first < pc.second) apply(k, pc, o.narrow(0, pc.first - mats[k].offset, pc.second - pc.first));
  }
  auto pos = offsets_of(back_recv_splits);
  for (size_t k = 0; k < mats.size(); ++k) {
    if (mats[k].root == me) continue;
    const auto pc = layout.piece(k, me);
    const int64_t n = pc.second - pc.first;
    if (n == 0) continue;
    apply(k, pc, back_recv.narrow(0, pos[mats[k].root], n));
    pos[mats[k].root] += n;
  }
}

std::vector<MuonParamGeometry> Muon::geometry(const std::vector<ParamShard>& params,
                                              const std::vector<int>& ns_steps) {
  std::vector<MuonParamGeometry> out;
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamShard& p = params[i];
    if (p.shape.empty() && p.full_numel() > 1) {
      throw std::invalid_argument("Muon: parameter '" + p.name + "' has no full shape "
                                  "(ParamShard.shape); use whole_param or param_shards");
    }
    MuonParamGeometry g;
    g.name = p.name;
    g.shape = p.shape;
    g.elem_begin = p.row_begin * p.row_len;
    g.elem_end = p.row_end * p.row_len;
    for (const auto& [b, e] : p.rank_rows) g.rank_elems.emplace_back(b * p.row_len, e * p.row_len);
    g.ns_steps = ns_steps[i];
    out.push_back(std::move(g));
  }
  return out;
}

namespace {
std::vector<int> steps_per_param(size_t n, const MuonOptions& o, std::vector<int> given) {
  if (given.empty()) return std::vector<int>(n, o.ns_steps);
  if (given.size() != n) {
    throw std::invalid_argument("Muon: " + std::to_string(given.size()) +
                                " ns_steps values for " + std::to_string(n) + " parameters");
  }
  return given;
}
}  // namespace

Muon::Muon(std::shared_ptr<Comm> comm, std::vector<ParamShard> params, MuonOptions options,
           std::vector<int> ns_steps)
    : GroupedOptimizer("Muon", std::move(params), std::move(comm), options.check_finite,
                       options.hyper),
      options_(options),
      layout_(comm_.get(), geometry(params_, steps_per_param(params_.size(), options, ns_steps))) {
  check_options(options.hyper);
  const at::ScalarType md = options_.momentum_dtype;
  if (md != at::kFloat && md != at::kBFloat16 && md != at::kByte) {
    throw std::invalid_argument("Muon: momentum_dtype must be float32, bfloat16 or int8 (8-bit "
                                "block-wise codes)");
  }
  if (eight_bit()) {
    if (options_.momentum_block < 1) {
      throw std::invalid_argument("Muon: momentum_block must be >= 1, got " +
                                  std::to_string(options_.momentum_block));
    }
    lut_ = quant::code_lut(quant::code_map(options_.momentum_map, /*is_signed=*/true));
  }
  for (const auto& p : params_) {
    if (!eight_bit()) {
      momenta_.push_back(at::zeros(p.param.sizes(), p.param.options().dtype(md)));
      continue;
    }
    if (p.param.is_cuda()) {
      throw std::invalid_argument("Muon: parameter '" + p.name + "' is on " + p.param.device().str() +
                                  "; 8-bit momentum runs on the CPU only so far (use "
                                  "momentum_dtype bfloat16 on a GPU)");
    }
    quant::check_whole_blocks(quant::BlockShape::blocks(options_.momentum_block), p.name,
                              p.full_rows, p.row_len, p.row_begin, p.rows());
    momenta_.push_back(at::zeros(p.param.sizes(), p.param.options().dtype(at::kByte)));
    absmax_.push_back(at::zeros({block_layout(absmax_.size()).num_blocks}, at::kFloat));
  }
  if (eight_bit()) {  // zero codes decode to the map's value nearest 0: store its code
    const uint8_t zero = lut_->nearest(0.0f);
    for (auto& q : momenta_) q.fill_(zero);
  }
}

quant::BlockLayout Muon::block_layout(size_t i) const {
  // The shard starts on a block edge (checked), so its blocks are the global tensor's.
  return quant::BlockLayout(quant::BlockShape::blocks(options_.momentum_block), 1,
                            params_.at(i).param.numel());
}

at::Tensor Muon::momentum(size_t i) const {
  if (!eight_bit()) return momenta_.at(i).to(at::kFloat);
  at::Tensor out = at::empty(momenta_.at(i).sizes(), at::kFloat);
  quant::cpu::dequantize(momenta_[i].data_ptr<uint8_t>(), absmax_.at(i).data_ptr<float>(),
                         block_layout(i), *lut_, out.data_ptr<float>());
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> Muon::state(size_t i) const {
  if (!eight_bit()) return {{"momentum_buffer", momenta_.at(i)}};
  return {{"momentum_codes", momenta_.at(i)}, {"momentum_absmax", absmax_.at(i)}};
}

void Muon::check_options(const MuonHyper& h) const {
  if (!(h.lr >= 0) || !(h.momentum >= 0 && h.momentum < 1) || !(h.weight_decay >= 0)) {
    throw std::invalid_argument("Muon: need lr >= 0, 0 <= momentum < 1, weight_decay >= 0; got lr=" +
                                std::to_string(h.lr) + ", momentum=" + std::to_string(h.momentum) +
                                ", weight_decay=" + std::to_string(h.weight_decay));
  }
}

void Muon::check_grad_of(size_t i, const at::Tensor& grad) const {
  const ParamShard& p = params_.at(i);
  if (!grad.defined()) {
    throw std::invalid_argument("Muon: parameter '" + p.name + "' needs a gradient on every rank "
                                "(every matrix is gathered and scattered each step); give zeros "
                                "where a rank has none");
  }
  check_grad(name(), p, grad);
}

void Muon::check_replicated_grads(const std::vector<at::Tensor>& grads) const {
  std::vector<size_t> rep;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (layout_.replicated(i)) rep.push_back(i);
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
          "Muon step: parameter '" + params_[rep[k / 2]].name + "' is replicated (every rank "
          "holds it whole) but its gradients differ between the ranks (their " +
          (k % 2 ? "sums of squares" : "sums") + " range from " + std::to_string(lo) + " to " +
          std::to_string(hi) + "); replicated parameters need equal gradients, as "
          "DistributedDataParallel gives them (all-reduce them first), or shard the model "
          "(fully_shard or FSDP2). Nothing was changed");
    }
  }
}

void Muon::run_step(StepGate& gate, const std::vector<size_t>& stepping) {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].grad.defined()) {  // set_grad refuses none: not given yet
      const std::string what = "parameter '" + params_[i].name + "' was given no gradient; every "
                               "parameter needs one on every rank (zeros where a rank has none)";
      if (!check_finite_) throw std::invalid_argument("Muon step: " + what);
      gate.fail(what, true);
      break;
    }
  }
  // Without the gradients' check (a caller that gates the step itself, as
  // Python's Muon does) no collective here; Newton–Schulz failures are agreed in muon_step.
  if (check_finite_) gate.agree();
  std::vector<at::Tensor> ps, gs;
  std::vector<MuonHyper> hyper;
  for (size_t i = 0; i < params_.size(); ++i) {
    ps.push_back(params_[i].param);
    gs.push_back(params_[i].grad);
    hyper.push_back(options_of(i));
  }
  check_replicated_grads(gs);
  const bool on_gpu = !ps.empty() && ps[0].is_cuda();
  const bool batch = options_.batch_newton_schulz.value_or(on_gpu);
  if (options_.momentum_dtype == at::kFloat) {
    muon_step(comm_.get(), layout_, ps, gs, momenta_, hyper, options_.ns_dtype, batch);
    return;
  }
  // bf16 / 8-bit: the new momentum (and the update) in fp32 now, stored on commit.
  const size_t P = params_.size();
  std::vector<at::Tensor> u(P), pending(P), pending_absmax(P);
  for (size_t i = 0; i < P; ++i) {
    const at::Tensor g = gs[i].contiguous().view(-1);
    const double beta = hyper[i].momentum;
    if (!eight_bit()) {  // bf16: torch's lerp in fp32, as muon_step's
      pending[i] = momenta_[i].view(-1).to(at::kFloat).lerp(g, 1.0 - beta);
      u[i] = hyper[i].nesterov ? g.lerp(pending[i], beta) : pending[i];
      continue;
    }
    pending[i] = at::empty_like(momenta_[i]);
    pending_absmax[i] = at::empty_like(absmax_[i]);
    u[i] = at::empty({g.numel()}, g.options());
    quant::cpu::momentum8bit_step(g.data_ptr<float>(), momenta_[i].data_ptr<uint8_t>(),
                                  absmax_[i].data_ptr<float>(), block_layout(i), *lut_,
                                  static_cast<float>(beta), hyper[i].nesterov,
                                  pending[i].data_ptr<uint8_t>(),
                                  pending_absmax[i].data_ptr<float>(), u[i].data_ptr<float>());
  }
  // (A momentum that overflowed makes u, and so Newton–Schulz's result, non-finite:
  // that failure is agreed in the step below.)
  muon_step_from_updates(comm_.get(), layout_, ps, u, hyper, options_.ns_dtype, batch, [&] {
    for (size_t i = 0; i < P; ++i) {
      momenta_[i].view(-1).copy_(pending[i].view(-1));
      if (eight_bit()) absmax_[i].copy_(pending_absmax[i]);
    }
  });
}

}  // namespace rfsdp
