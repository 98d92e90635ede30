#include "optimizers/shampoo/shampoo.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <tuple>

#include "optimizers/common/step_gate.h"
#include "optimizers/common/matrices.h"

namespace rfsdp {

namespace {

void check_config(const ShampooConfig& c) {
  if (c.max_preconditioner_dim < 1) {
    throw std::invalid_argument("Shampoo: max_preconditioner_dim must be >= 1");
  }
  if (c.precondition_frequency < 1) {
    throw std::invalid_argument("Shampoo: precondition_frequency must be >= 1");
  }
  if (c.start_preconditioning_step < c.precondition_frequency) {
    throw std::invalid_argument(
        "Shampoo: start_preconditioning_step (" + std::to_string(c.start_preconditioning_step) +
        ") must be >= precondition_frequency (" + std::to_string(c.precondition_frequency) +
        "), so that the roots exist when preconditioning starts");
  }
  if (c.factor_dtype != at::kFloat && c.factor_dtype != at::kBFloat16) {
    throw std::invalid_argument("Shampoo: factor_dtype must be float32 or bfloat16");
  }
  if (!(c.rank_rtol < 1)) {  // NaN, or every eigenvalue dropped
    throw std::invalid_argument("Shampoo: rank_rtol must be < 1 (negative: n * eps(float32))");
  }
  if (c.basis_bits != 0) {
    quant::check_lowbit_format("Shampoo", c.basis_bits, c.basis_block, c.basis_map, c.bjorck_iterations);
  }
}

std::string tile_name(const ParamShard& p, const ShampooTile& t) {
  return "parameter '" + p.name + "' tile of matrix " + std::to_string(t.matrix) + " rows [" +
         std::to_string(t.row0) + ", " + std::to_string(t.row0 + t.rows) + ") columns [" +
         std::to_string(t.col0) + ", " + std::to_string(t.col0 + t.cols) + ")";
}

// On a GPU: the flat positions of an n x n matrix's upper triangle, row by row
// (the packed order), and of their mirror images; made once per size and device.
struct TriangleIndex {
  at::Tensor upper, lower;  // int64 [n (n + 1) / 2]
};
const TriangleIndex& triangle_index(int64_t n, const at::Device& device) {
  static std::mutex mu;
  static std::map<std::tuple<int64_t, int, int>, TriangleIndex> cache;
  std::lock_guard<std::mutex> lock(mu);
  TriangleIndex& t = cache[{n, static_cast<int>(device.type()), static_cast<int>(device.index())}];
  if (!t.upper.defined()) {
    const at::Tensor ij = at::triu_indices(n, n, 0, at::TensorOptions(at::kLong).device(device));
    t.upper = ij[0] * n + ij[1];
    t.lower = ij[1] * n + ij[0];
  }
  return t;
}

}  // namespace

int64_t shampoo_granule_rows(const std::vector<int64_t>& shape, int row_dims, int64_t max_dim) {
  if (shape.size() <= 1) return 1;  // not preconditioned: any boundary
  if (shape.size() == 3 && row_dims == 2) {  // E*H rows: tiles of B rows inside each expert
    return shape[1] % max_dim == 0 ? max_dim : shape[1];
  }
  if (shape.size() == 3 && row_dims == 1) return 1;  // a row is a whole expert
  if (row_dims == 1) return max_dim;                 // bands of B rows of dim 0
  throw std::invalid_argument("Shampoo: rows of " + std::to_string(row_dims) +
                              " dims of a " + std::to_string(shape.size()) +
                              "-D tensor are not supported (use row_dims 1, or 2 for [E, H, I])");
}

namespace {

// The largest power of two up to max_dim that divides every rank boundary of p
// (in rows of dim 0 of a matrix parameter): a max_preconditioner_dim whose tiles
// those boundaries never cut. 0 if the rows are not those of a 2-D matrix.
int64_t whole_tile_dim(const ParamShard& p, int64_t max_dim) {
  if (p.shape.size() != 2 || p.row_dims != 1) return 0;
  int64_t g = std::gcd(p.row_begin, p.row_end);
  for (const auto& [b, e] : p.rank_rows) g = std::gcd(g, std::gcd(b, e));
  if (g == 0) return 0;
  int64_t d = 1;
  while (d * 2 <= max_dim && g % (d * 2) == 0) d *= 2;
  return d;
}

}  // namespace

std::vector<ShampooTile> shampoo_tiles(const char* who, const ParamShard& p, size_t param,
                                       int64_t max_dim, int rank,
                                       std::vector<SharedTileRow>* shared) {
  std::vector<ShampooTile> out;
  const int64_t e0 = p.row_begin * p.row_len, e1 = e0 + p.param.numel();
  int64_t left = 0, right = 0;
  auto add_tiles = [&](int64_t k, const MatrixView& m, int64_t r0, int64_t rows, int64_t first,
                       int64_t shared_row) {
    for (int64_t c0 = 0; c0 < m.cols; c0 += max_dim) {
      const int64_t cols = std::min(max_dim, m.cols - c0);
      out.push_back({param, k, r0, rows, c0, cols, first + c0, m.cols, left, right, shared_row});
      left += shampoo_packed_size(rows);
      right += shampoo_packed_size(cols);
    }
  };
  const auto mats = matrices_of(p.shape);
  for (size_t k = 0; k < mats.size(); ++k) {
    const MatrixView& m = mats[k];
    for (int64_t r0 = 0; r0 < m.rows; r0 += max_dim) {
      const int64_t rows = std::min(max_dim, m.rows - r0);
      const int64_t lo = m.offset + r0 * m.cols, hi = lo + rows * m.cols;
      if (m.cols == 0) continue;
      if (shared && p.knows_every_rank()) {  // a row of tiles that several ranks hold: shared
        SharedTileRow row{param, static_cast<int64_t>(k), r0, rows, m.cols, lo, hi, -1, {}};
        int holders = 0;
        for (size_t r = 0; r < p.rank_rows.size(); ++r) {
          const int64_t b = std::max(lo, p.rank_rows[r].first * p.row_len);
          const int64_t e = std::min(hi, p.rank_rows[r].second * p.row_len);
          row.parts.push_back(e > b ? std::make_pair(b, e) : std::make_pair(int64_t{0}, int64_t{0}));
          if (e > b) ++holders;
          if (e > b && b == lo) row.owner = static_cast<int>(r);
        }
        if (holders > 1) {
          shared->push_back(row);
          if (row.owner == rank) {
            add_tiles(static_cast<int64_t>(k), m, r0, rows, 0,
                      static_cast<int64_t>(shared->size()) - 1);
          }
          continue;
        }
      }
      if (hi <= e0 || lo >= e1) continue;  // another rank's
      if (lo < e0 || hi > e1) {
        const int64_t d = whole_tile_dim(p, max_dim);
        std::string fixes =
            "keep every tile on one rank: with rfsdp.fully_shard, plan the unit with "
            "rfsdp.policy.shampoo(max_preconditioner_dim=" + std::to_string(max_dim) + ")";
        if (d > 1) {
          fixes += "; with torch's fully_shard (FSDP2's chunk rows), or these rows, "
                   "max_preconditioner_dim=" + std::to_string(d) + " divides every rank's "
                   "first row";
        }
        fixes += shared ? "; or describe the shard with every rank's rows (as FSDP2's DTensors "
                          "and rfsdp's plans do) so the ranks share the cut tiles"
                        : std::string("; or use Shampoo, whose ranks share cut tiles (") + who +
                              " does not yet)";
        throw std::invalid_argument(
            std::string(who) + ": parameter '" + p.name + "': this shard holds elements [" +
            std::to_string(e0) + ", " + std::to_string(e1) + "), which cut the tile rows [" +
            std::to_string(r0) + ", " + std::to_string(r0 + rows) + ") of matrix " +
            std::to_string(k) + " (tiles of up to max_preconditioner_dim=" +
            std::to_string(max_dim) + " rows); " + fixes);
      }
      add_tiles(static_cast<int64_t>(k), m, r0, rows, lo - e0, -1);
    }
  }
  return out;
}

RankDeficient parse_rank_deficient(const std::string& s) {
  if (s == "shift") return RankDeficient::Shift;
  if (s == "pseudo_inverse") return RankDeficient::PseudoInverse;
  if (s == "strict") return RankDeficient::Strict;
  throw std::invalid_argument("Shampoo: rank_deficient must be \"shift\", \"pseudo_inverse\" or "
                              "\"strict\", got \"" + s + "\"");
}

const char* to_string(RankDeficient r) {
  switch (r) {
    case RankDeficient::Shift: return "shift";
    case RankDeficient::PseudoInverse: return "pseudo_inverse";
    case RankDeficient::Strict: return "strict";
  }
  return "?";
}

std::vector<at::Tensor> inverse_fourth_roots(const std::vector<at::Tensor>& a,
                                             std::vector<bool>* ok, int64_t* retries,
                                             const RootRule& rule,
                                             std::vector<std::pair<at::Tensor, at::Tensor>>* eigen) {
  const size_t n = a.size();
  if (rule.mode == RankDeficient::Shift && rule.floors.size() != n) {
    throw std::invalid_argument("inverse_fourth_roots: the shift rule needs one floor per matrix");
  }
  std::vector<at::Tensor> out(n);
  ok->assign(n, false);
  if (eigen) eigen->assign(n, {});
  if (n == 0) return out;
  // One eigendecomposition A = Q diag(l) Q^T gives A^-1/4 = Q diag(s) Q^T, with
  // s = l^-1/4 for the eigenvalues the rule keeps (after its shift) and 0 for those
  // it drops; a failure where l or the root is not finite, or (Strict) l <= 0.
  auto root = [&](size_t k, at::Tensor l, const at::Tensor& q, at::Tensor* r) {
    if (!at::isfinite(l).all().item<bool>()) return false;
    at::Tensor s;
    if (rule.mode == RankDeficient::PseudoInverse) {
      const double rtol = rule.rtol >= 0 ? rule.rtol
                                         : static_cast<double>(l.size(-1)) *
                                               std::numeric_limits<float>::epsilon();
      const double cut = std::max(0.0, rtol * l.max().item<double>());
      const at::Tensor keep = l > cut;
      s = at::where(keep, at::where(keep, l, at::ones_like(l)).pow(-0.25), at::zeros_like(l));
    } else {
      if (rule.mode == RankDeficient::Shift) {
        const double lo = l.min().item<double>();
        if (lo < rule.floors[k]) l = l - lo + rule.floors[k];
      }
      if (!(l > 0).all().item<bool>()) return false;
      s = l.pow(-0.25);
    }
    *r = at::matmul(q * s.unsqueeze(-2), q.transpose(-1, -2));
    if (!at::isfinite(*r).all().item<bool>()) return false;
    if (eigen) (*eigen)[k] = {q.to(at::kFloat), s.to(at::kFloat)};
    return true;
  };
  auto single = [&](size_t k, at::ScalarType dt, at::Tensor* r) {
    try {
      auto [l, q] = at::linalg_eigh(a[k].to(dt));
      return root(k, l, q, r);
    } catch (const c10::Error&) {
      return false;  // no convergence
    }
  };
  std::vector<bool> batch_tried(n, false);
  try {
    auto [l, q] = at::linalg_eigh(at::stack(a).to(at::kFloat));
    for (size_t k = 0; k < n; ++k) {
      at::Tensor r;
      batch_tried[k] = true;
      if (root(k, l[k], q[k], &r)) out[k] = r, (*ok)[k] = true;
    }
  } catch (const c10::Error&) {
    // Some matrix did not converge: each is tried alone below.
  }
  for (size_t k = 0; k < n; ++k) {
    if ((*ok)[k]) continue;
    at::Tensor r;
    if (!batch_tried[k] && single(k, at::kFloat, &r)) {
      out[k] = r, (*ok)[k] = true;
      continue;
    }
    if (retries) ++*retries;
    if (single(k, at::kDouble, &r)) out[k] = r.to(at::kFloat), (*ok)[k] = true;
  }
  return out;
}

void Shampoo::check_options(const ShampooOptions& o) const {
  if (!(o.lr >= 0) || !(o.beta1 >= 0 && o.beta1 < 1) || !(o.beta2 >= 0 && o.beta2 <= 1) ||
      !(o.epsilon >= 0) || !(o.grafting_beta2 >= 0 && o.grafting_beta2 < 1) ||
      !(o.grafting_epsilon > 0) || !(o.weight_decay >= 0)) {
    throw std::invalid_argument(
        "Shampoo: need lr >= 0, 0 <= beta1 < 1, 0 <= beta2 <= 1, epsilon >= 0, "
        "0 <= grafting_beta2 < 1, grafting_epsilon > 0, weight_decay >= 0");
  }
  if (config_.rank_deficient == RankDeficient::Shift && !(o.epsilon > 0)) {
    throw std::invalid_argument(
        "Shampoo: rank_deficient=\"shift\" lifts the smallest eigenvalue of every factor to "
        "epsilon, so it needs epsilon > 0 (got 0); use rank_deficient=\"pseudo_inverse\" for "
        "epsilon = 0");
  }
}

Shampoo::Shampoo(std::vector<ParamShard> params, ShampooOptions options, ShampooConfig config,
                 std::shared_ptr<Comm> comm, std::vector<bool> precondition)
    : GroupedOptimizer("Shampoo", std::move(params), std::move(comm), config.check_finite, options),
      config_(config) {
  check_config(config_);
  check_options(options);
  const size_t n = params_.size();
  if (!precondition.empty() && precondition.size() != n) {
    throw std::invalid_argument("Shampoo: " + std::to_string(precondition.size()) +
                                " precondition flags for " + std::to_string(n) + " parameters");
  }
  const auto fdt = at::TensorOptions().dtype(config_.factor_dtype);
  for (size_t i = 0; i < n; ++i) {
    const ParamShard& p = params_[i];
    precondition_.push_back((precondition.empty() || precondition[i]) && p.shape.size() >= 2);
    ParamState s;
    s.m = at::zeros(p.param.sizes(), state_options(i));
    s.v = at::zeros(p.param.sizes(), state_options(i));
    if (precondition_[i]) {
      const size_t shared_before = shared_.size();
      const int rank = comm_ ? comm_->rank() : 0;
      for (const ShampooTile& t : shampoo_tiles("Shampoo", p, i, config_.max_preconditioner_dim, rank,
                                                &shared_)) {
        s.tiles.push_back(tiles_.size());
        tiles_.push_back(t);
      }
      if (shared_.size() > shared_before) {
        if (!comm_ || comm_->size() != static_cast<int>(p.rank_rows.size())) {
          throw std::invalid_argument(
              "Shampoo: parameter '" + p.name + "' has rows of tiles that its ranks' shards cut; "
              "the ranks holding one send it to its owner, so the optimizer needs their process "
              "group (" + std::to_string(p.rank_rows.size()) + " ranks; it has " +
              (comm_ ? std::to_string(comm_->size()) : std::string("none")) + ")");
        }
        if (p.param.is_cuda()) {
          throw std::invalid_argument(
              "Shampoo: parameter '" + p.name + "': its shard (rows [" +
              std::to_string(p.row_begin) + ", " + std::to_string(p.row_end) + ")) cuts tiles of " +
              std::to_string(config_.max_preconditioner_dim) + " rows, and tiles shared by ranks "
              "are preconditioned on the CPU only so far; on a GPU, give every rank whole tiles "
              "(rfsdp.fully_shard with rfsdp.policy.shampoo), or choose a "
              "max_preconditioner_dim that the rows keep whole");
        }
      }
      int64_t left = 0, right = 0;
      for (size_t k : s.tiles) {
        left += shampoo_packed_size(tiles_[k].rows);
        right += shampoo_packed_size(tiles_[k].cols);
      }
      const auto on = fdt.device(p.param.device());  // factors live with the shard
      s.left = at::zeros({left}, on);
      s.right = at::zeros({right}, on);
      if (const int bits = config_.basis_bits) {  // roots start as the identity: Q = I, s = 1
        std::vector<int64_t> rows, cols;
        int64_t sl = 0, sr = 0;
        for (size_t k : s.tiles) {
          s.sl.push_back(sl);
          s.sr.push_back(sr);
          rows.push_back(tiles_[k].rows);
          cols.push_back(tiles_[k].cols);
          sl += tiles_[k].rows;
          sr += tiles_[k].cols;
        }
        const auto f32 = on.dtype(at::kFloat);
        s.q_l = quant::LowbitSquares(rows, bits, config_.basis_block, config_.basis_map,
                                     config_.bjorck_iterations, f32);
        s.q_r = quant::LowbitSquares(cols, bits, config_.basis_block, config_.basis_map,
                                     config_.bjorck_iterations, f32);
        for (size_t j = 0; j < s.tiles.size(); ++j) {
          s.q_l.store(j, at::eye(rows[j], f32));
          s.q_r.store(j, at::eye(cols[j], f32));
        }
        s.s_l = at::ones({sl}, f32);
        s.s_r = at::ones({sr}, f32);
      } else {
        s.root_l = at::zeros({left}, on);
        s.root_r = at::zeros({right}, on);
        for (size_t k : s.tiles) {  // roots start as the identity
          const ShampooTile& t = tiles_[k];
          s.root_l.narrow(0, t.left_offset, shampoo_packed_size(t.rows)).copy_(pack(at::eye(t.rows)));
          s.root_r.narrow(0, t.right_offset, shampoo_packed_size(t.cols)).copy_(pack(at::eye(t.cols)));
        }
      }
      s.failures = at::zeros({static_cast<int64_t>(s.tiles.size())}, at::kLong);
    }
    state_.push_back(std::move(s));
  }
  // The shared rows' parts on each side of the exchanges, and the owner's buffers.
  const int me = comm_ ? comm_->rank() : 0;
  for (size_t j = 0; j < shared_.size(); ++j) {
    const SharedTileRow& row = shared_[j];
    const ParamShard& p = params_[row.param];
    const int64_t n = row.end - row.begin;
    const bool owner = row.owner == me;
    shared_g_.push_back(owner ? at::zeros({n}, at::kFloat) : at::Tensor());
    shared_m_.push_back(owner ? at::zeros({n}, at::kFloat) : at::Tensor());
    shared_d_.push_back(owner ? at::zeros({n}, at::kFloat) : at::Tensor());
    for (size_t r = 0; r < row.parts.size(); ++r) {
      const auto [b, e] = row.parts[r];
      if (e <= b) continue;
      if (static_cast<int>(r) == me) {
        held_parts_.push_back({j, row.owner, b - p.row_begin * p.row_len, b - row.begin, e - b});
      }
      if (owner) owned_parts_.push_back({j, static_cast<int>(r), -1, b - row.begin, e - b});
    }
  }
  std::stable_sort(held_parts_.begin(), held_parts_.end(),
                   [](const PartRef& a, const PartRef& b) { return a.peer < b.peer; });
  std::stable_sort(owned_parts_.begin(), owned_parts_.end(),
                   [](const PartRef& a, const PartRef& b) { return a.peer < b.peer; });
}

void Shampoo::exchange(bool forward, int64_t head, int64_t width,
                       const std::function<void(const PartRef&, float*)>& fill,
                       const std::function<void(const PartRef&, const float*)>& take) {
  const std::vector<PartRef>& send_parts = forward ? held_parts_ : owned_parts_;
  const std::vector<PartRef>& recv_parts = forward ? owned_parts_ : held_parts_;
  const int world = comm_->size();
  std::vector<int64_t> send_splits(world, 0), recv_splits(world, 0);
  int64_t sends = 0, recvs = 0;
  for (const PartRef& q : send_parts) send_splits[q.peer] += head + width * q.n;
  for (const PartRef& q : recv_parts) recv_splits[q.peer] += head + width * q.n;
  for (int r = 0; r < world; ++r) sends += send_splits[r], recvs += recv_splits[r];
  at::Tensor send = at::empty({sends}, at::kFloat), recv = at::empty({recvs}, at::kFloat);
  float* out = send.data_ptr<float>();
  for (const PartRef& q : send_parts) {
    fill(q, out);
    out += head + width * q.n;
  }
  comm_->all_to_all(recv, send, recv_splits, send_splits).wait();
  const float* in = recv.data_ptr<float>();
  for (const PartRef& q : recv_parts) {
    take(q, in);
    in += head + width * q.n;
  }
}

at::Tensor Shampoo::grad_tile(size_t i, const ShampooTile& t) const {
  return shampoo_tile_view(t.shared >= 0 ? shared_g_[t.shared] : params_[i].grad.view({-1}), t);
}

// Row i of the upper triangle, columns [i, n), follows rows 0..i-1: plain copies
// at memory speed (an index_select/index_copy pair cost 30% of a step).
at::Tensor Shampoo::pack(const at::Tensor& full) {
  const at::Tensor f = full.to(at::kFloat).contiguous();
  const int64_t n = f.size(0);
  if (!f.is_cpu()) {  // on a GPU: one gather of the upper triangle (row by row)
    return f.view(-1).index_select(0, triangle_index(n, f.device()).upper);
  }
  at::Tensor out = at::empty({shampoo_packed_size(n)}, at::kFloat);
  const float* src = f.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    std::copy(src + i * n + i, src + (i + 1) * n, dst);
    dst += n - i;
  }
  return out;
}

at::Tensor Shampoo::unpack(const at::Tensor& flat, int64_t offset, int64_t n) {
  const at::Tensor packed = flat.narrow(0, offset, shampoo_packed_size(n)).to(at::kFloat).contiguous();
  if (!packed.is_cpu()) {  // on a GPU: two scatters (the mirror, then the upper triangle)
    const TriangleIndex& ix = triangle_index(n, packed.device());
    at::Tensor full = at::empty({n * n}, packed.options());
    full.index_put_({ix.lower}, packed);
    full.index_put_({ix.upper}, packed);
    return full.view({n, n});
  }
  at::Tensor full = at::empty({n, n}, at::kFloat);
  const float* src = packed.data_ptr<float>();
  float* dst = full.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    std::copy(src, src + (n - i), dst + i * n + i);
    src += n - i;
  }
  for (int64_t i = 1; i < n; ++i) {  // the lower triangle mirrors the upper
    for (int64_t j = 0; j < i; ++j) dst[i * n + j] = dst[j * n + i];
  }
  return full;
}

void Shampoo::compute_roots(const std::vector<size_t>& due, const std::vector<at::Tensor>& new_left,
                            const std::vector<at::Tensor>& new_right,
                            std::vector<std::pair<NewRoot, NewRoot>>* new_roots) {
  const auto t0 = std::chrono::steady_clock::now();
  // Every factor whose root is due, grouped by size: one batched eigh per size.
  struct Job {
    size_t tile;
    bool left;
  };
  std::map<int64_t, std::vector<Job>> by_size;
  std::map<int64_t, std::vector<at::Tensor>> mats;
  std::map<int64_t, RootRule> rules;
  for (size_t i : due) {
    const ParamState& s = state_[i];
    const ShampooOptions& o = options_of(i);
    const bool correct = config_.use_bias_correction && o.beta2 < 1;
    const double bc = correct ? 1.0 - std::pow(o.beta2, static_cast<double>(param_steps_[i])) : 1.0;
    for (size_t k : s.tiles) {
      const ShampooTile& t = tiles_[k];
      for (bool left : {true, false}) {
        const int64_t d = left ? t.rows : t.cols;
        at::Tensor a = unpack(left ? new_left[k] : new_right[k], 0, d) / bc;
        a.diagonal().add_(o.epsilon);
        by_size[d].push_back({k, left});
        mats[d].push_back(a);
        RootRule& rule = rules[d];
        rule.mode = config_.rank_deficient;
        rule.rtol = config_.rank_rtol;
        if (rule.mode == RankDeficient::Shift) rule.floors.push_back(o.epsilon);
      }
    }
  }
  std::vector<bool> failed(tiles_.size(), false);
  const bool quantised = config_.basis_bits != 0;
  for (auto& [d, jobs] : by_size) {
    std::vector<bool> ok;
    std::vector<std::pair<at::Tensor, at::Tensor>> eigen;
    const auto roots = inverse_fourth_roots(mats[d], &ok, &fp64_retries_, rules[d],
                                            quantised ? &eigen : nullptr);
    for (size_t j = 0; j < jobs.size(); ++j) {
      if (!ok[j]) {  // the previous root is kept
        failed[jobs[j].tile] = true;
        continue;
      }
      auto& slot = (*new_roots)[jobs[j].tile];
      NewRoot& r = jobs[j].left ? slot.first : slot.second;
      if (quantised) {
        r.q = eigen[j].first, r.s = eigen[j].second;
      } else {
        r.packed = pack(roots[j]);
      }
    }
  }
  root_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (size_t i : due) {
    const ParamState& s = state_[i];
    for (size_t j = 0; j < s.tiles.size(); ++j) {
      const size_t k = s.tiles[j];
      if (failed[k]) {
        if (s.failures.data_ptr<int64_t>()[j] + 1 >= 3) {
          throw std::runtime_error(
              "the inverse roots of " + tile_name(params_[i], tiles_[k]) +
              " failed 3 times in a row in fp32 and fp64 (" +
              (config_.rank_deficient == RankDeficient::Strict
                   ? std::string("non-finite or non-positive eigenvalues, or no convergence: "
                                 "rank_deficient=\"strict\" refuses rank-deficient factors; use "
                                 "\"shift\" or \"pseudo_inverse\", or raise epsilon")
                   : std::string("non-finite eigenvalues or roots, or no convergence: check the "
                                 "gradients")) +
              ")");
        }
      }
    }
  }
}

void Shampoo::run_step(StepGate& gate, const std::vector<size_t>& stepping) {
  at::NoGradGuard no_grad;
  // What this step would store, computed before anything changes: the factors of
  // the tiles whose roots are due (packed, in the factor dtype), and their roots.
  std::vector<size_t> due;
  for (size_t i : stepping) {
    if (precondition_[i] && param_steps_[i] % config_.precondition_frequency == 0) {
      due.push_back(i);
    }
  }
  std::vector<bool> steps(params_.size(), false);
  for (size_t i : stepping) steps[i] = true;
  if (!shared_.empty()) {
    // The shared rows' gradients to their owners (with "has a gradient" flags:
    // a row stepped on some of its ranks and not on others is refused).
    std::string mismatch;
    exchange(
        true, 1, 1,
        [&](const PartRef& q, float* dst) {
          const size_t i = shared_[q.row].param;
          dst[0] = steps[i] ? 1.0f : 0.0f;
          if (steps[i]) {
            std::copy_n(params_[i].grad.data_ptr<float>() + q.local, q.n, dst + 1);
          } else {
            std::fill_n(dst + 1, q.n, 0.0f);
          }
        },
        [&](const PartRef& q, const float* src) {
          const size_t i = shared_[q.row].param;
          if ((src[0] > 0) != steps[i] && mismatch.empty()) {
            mismatch = "parameter '" + params_[i].name + "' has a gradient on some of the ranks "
                       "that share a row of its tiles and none on others (rank " +
                       std::to_string(q.peer) + (src[0] > 0 ? " has one" : " has none") +
                       "); give every rank a gradient for it (zeros where it has none), or none "
                       "on any";
          }
          std::copy_n(src + 1, q.n, shared_g_[q.row].data_ptr<float>() + q.at);
        });
    if (!mismatch.empty()) gate.fail(mismatch, true);
  }
  std::vector<at::Tensor> new_left(tiles_.size()), new_right(tiles_.size());
  std::vector<std::pair<NewRoot, NewRoot>> new_roots(tiles_.size());
  if (!due.empty()) {
    gate.check_device_now();  // no roots of NaN gradients (counted as root failures)
    if (!gate.failed()) {
      gate.guard([&] {
        for (size_t i : due) {
          for (size_t k : state_[i].tiles) {
            const ShampooTile& tl = tiles_[k];
            new_left[k] = at::empty({shampoo_packed_size(tl.rows)}, state_[i].left.options());
            new_right[k] = at::empty({shampoo_packed_size(tl.cols)}, state_[i].right.options());
            update_factors(i, k, new_left[k], new_right[k]);
          }
        }
        compute_roots(due, new_left, new_right, &new_roots);
      });
    }
  }
  gate.agree();  // every rank can take the step: from here on it changes state
  for (size_t i : stepping) {
    const ShampooOptions& o = options_of(i);
    ParamState& s = state_[i];
    const at::Tensor g = params_[i].grad.view({-1});
    s.v.view({-1}).mul_(o.grafting_beta2).addcmul_(g, g, 1.0 - o.grafting_beta2);
    s.m.view({-1}).mul_(o.beta1).add_(g, 1.0 - o.beta1);
    if (precondition_[i]) {
      for (size_t j = 0; j < s.tiles.size(); ++j) {
        const size_t k = s.tiles[j];
        const ShampooTile& tl = tiles_[k];
        at::Tensor l = s.left.narrow(0, tl.left_offset, shampoo_packed_size(tl.rows));
        at::Tensor r = s.right.narrow(0, tl.right_offset, shampoo_packed_size(tl.cols));
        if (new_left[k].defined()) {  // due: computed above
          l.copy_(new_left[k]);
          r.copy_(new_right[k]);
          // Each side's new root where it succeeded; a failed side keeps its old one.
          const auto& [root_l, root_r] = new_roots[k];
          if (root_l.defined()) store_root(i, j, true, root_l);
          if (root_r.defined()) store_root(i, j, false, root_r);
          int64_t& f = s.failures.data_ptr<int64_t>()[j];
          f = root_l.defined() && root_r.defined() ? 0 : f + 1;
        } else {
          update_factors(i, k, l, r);
        }
      }
    }
  }
  // P = L^-1/4 M^ R^-1/4 scaled to |D| in tile j of parameter i's (D where |P| = 0).
  auto precondition_tile = [&](size_t i, size_t j, at::Tensor d, const at::Tensor& m_hat) {
    const at::Tensor rl = root(i, j, true), rr = root(i, j, false);
    at::Tensor p = at::matmul(at::matmul(rl, m_hat), rr);
    if (p.is_cuda()) {  // the same on the device, with no host wait per tile
      const at::Tensor np = p.norm();
      d.copy_(at::where(np > 0, p * (d.norm() / np), d));
      return;
    }
    const double np = p.norm().item<double>();
    if (np > 0) d.copy_(p.mul_(d.norm().item<double>() / np));  // else keep D
  };
  auto preconditions = [&](size_t i) {
    return precondition_[i] && param_steps_[i] >= config_.start_preconditioning_step;
  };
  std::vector<at::Tensor> update(params_.size()), m_hats(params_.size());
  for (size_t i : stepping) {
    const int64_t t = param_steps_[i];
    const ShampooOptions& o = options_of(i);
    ParamState& s = state_[i];
    const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(t));
    const double bc2g = 1.0 - std::pow(o.grafting_beta2, static_cast<double>(t));
    const at::Tensor m_hat = s.m.view({-1}) / bc1;
    at::Tensor u = m_hat / ((s.v.view({-1}) / bc2g).sqrt_().add_(o.grafting_epsilon));  // D
    if (preconditions(i)) {
      for (size_t j = 0; j < s.tiles.size(); ++j) {
        const ShampooTile& tl = tiles_[s.tiles[j]];
        if (tl.shared < 0) {
          precondition_tile(i, j, shampoo_tile_view(u, tl), shampoo_tile_view(m_hat, tl));
        }
      }
    }
    update[i] = u;
    m_hats[i] = m_hat;
  }
  if (!shared_.empty()) {
    // The shared rows' M^ and D to their owners, which precondition their tiles
    // and send each holder its rows of the update.
    exchange(
        true, 0, 2,
        [&](const PartRef& q, float* dst) {
          const size_t i = shared_[q.row].param;
          if (!steps[i]) {
            std::fill_n(dst, 2 * q.n, 0.0f);
            return;
          }
          std::copy_n(m_hats[i].data_ptr<float>() + q.local, q.n, dst);
          std::copy_n(update[i].data_ptr<float>() + q.local, q.n, dst + q.n);
        },
        [&](const PartRef& q, const float* src) {
          std::copy_n(src, q.n, shared_m_[q.row].data_ptr<float>() + q.at);
          std::copy_n(src + q.n, q.n, shared_d_[q.row].data_ptr<float>() + q.at);
        });
    for (size_t i : stepping) {
      if (!preconditions(i)) continue;
      const ParamState& s = state_[i];
      for (size_t j = 0; j < s.tiles.size(); ++j) {
        const ShampooTile& tl = tiles_[s.tiles[j]];
        if (tl.shared >= 0) {
          precondition_tile(i, j, shampoo_tile_view(shared_d_[tl.shared], tl),
                            shampoo_tile_view(shared_m_[tl.shared], tl));
        }
      }
    }
    exchange(
        false, 0, 1,
        [&](const PartRef& q, float* dst) {
          std::copy_n(shared_d_[q.row].data_ptr<float>() + q.at, q.n, dst);
        },
        [&](const PartRef& q, const float* src) {
          const size_t i = shared_[q.row].param;
          if (steps[i]) std::copy_n(src, q.n, update[i].data_ptr<float>() + q.local);
        });
  }
  for (size_t i : stepping) {
    const ShampooOptions& o = options_of(i);
    params_[i].param.view({-1}).mul_(1.0 - o.lr * o.weight_decay).add_(update[i], -o.lr);
  }
}

void Shampoo::update_factors(size_t i, size_t k, const at::Tensor& l_out,
                             const at::Tensor& r_out) const {
  const ShampooOptions& o = options_of(i);
  const ParamState& s = state_[i];
  const ShampooTile& tl = tiles_[k];
  const double c = o.beta2 < 1 ? 1.0 - o.beta2 : 1.0;
  // A fresh copy: BLAS rounds G G^T differently as the tile's address is aligned
  // differently (seen at 8-byte alignment), which the shard layout decides; so
  // that the factors (and codes) do not depend on the ranks.
  const at::Tensor gt = grad_tile(i, tl).clone();
  // f <- b2 f + c gg in fp32 (the same two operations whether out is f itself or
  // a new tensor, so both round alike), stored in the factor dtype.
  auto update = [&](const at::Tensor& f, const at::Tensor& gg, at::Tensor out) {
    if (f.scalar_type() == at::kFloat) {
      at::mul_out(out, f, o.beta2).add_(gg, c);
    } else {  // bf16: through a float32 copy
      out.copy_(f.to(at::kFloat).mul_(o.beta2).add_(gg, c));
    }
  };
  update(s.left.narrow(0, tl.left_offset, shampoo_packed_size(tl.rows)), pack(at::mm(gt, gt.t())),
         l_out);
  update(s.right.narrow(0, tl.right_offset, shampoo_packed_size(tl.cols)), pack(at::mm(gt.t(), gt)),
         r_out);
}

std::vector<std::pair<std::string, at::Tensor>> Shampoo::state(size_t i) const {
  const ParamState& s = state_.at(i);
  std::vector<std::pair<std::string, at::Tensor>> out{{"exp_avg", s.m}, {"exp_avg_sq", s.v}};
  if (precondition_[i]) {
    out.insert(out.end(), {{"factor_left", s.left}, {"factor_right", s.right}});
    if (config_.basis_bits) {
      out.insert(out.end(), {{"root_left_basis_codes", s.q_l.codes()},
                             {"root_left_basis_absmax", s.q_l.absmax()},
                             {"root_left_eigenvalues", s.s_l},
                             {"root_right_basis_codes", s.q_r.codes()},
                             {"root_right_basis_absmax", s.q_r.absmax()},
                             {"root_right_eigenvalues", s.s_r}});
    } else {
      out.insert(out.end(), {{"root_left", s.root_l}, {"root_right", s.root_r}});
    }
    out.push_back({"root_failures", s.failures});
  }
  return out;
}

at::Tensor Shampoo::root(size_t i, size_t j, bool left) const {
  const ParamState& s = state_.at(i);
  const ShampooTile& tl = tiles_[s.tiles.at(j)];
  const int64_t n = left ? tl.rows : tl.cols;
  if (!config_.basis_bits) {
    return unpack(left ? s.root_l : s.root_r, left ? tl.left_offset : tl.right_offset, n);
  }
  const at::Tensor q = (left ? s.q_l : s.q_r).orthogonal(j);
  const at::Tensor d = (left ? s.s_l : s.s_r).narrow(0, left ? s.sl[j] : s.sr[j], n);
  return at::matmul(q * d.unsqueeze(0), q.t());
}

void Shampoo::store_root(size_t i, size_t j, bool left, const NewRoot& r) {
  ParamState& s = state_[i];
  const ShampooTile& tl = tiles_[s.tiles[j]];
  const int64_t n = left ? tl.rows : tl.cols;
  if (!config_.basis_bits) {
    (left ? s.root_l : s.root_r).narrow(0, left ? tl.left_offset : tl.right_offset,
                                        shampoo_packed_size(n)).copy_(r.packed);
    return;
  }
  (left ? s.q_l : s.q_r).store(j, r.q);
  (left ? s.s_l : s.s_r).narrow(0, left ? s.sl[j] : s.sr[j], n).copy_(r.s);
}

int64_t Shampoo::factor_bytes() const {
  int64_t b = 0;
  for (const auto& s : state_) {
    for (const at::Tensor* t : {&s.left, &s.right, &s.root_l, &s.root_r, &s.s_l, &s.s_r}) {
      if (t->defined()) b += t->nbytes();
    }
    b += s.q_l.nbytes() + s.q_r.nbytes();
  }
  return b;
}

double Shampoo::root_flops() const {
  double f = 0;
  for (const auto& t : tiles_) f += 9.0 * (std::pow(t.rows, 3) + std::pow(t.cols, 3));
  return f;
}

}  // namespace rfsdp
