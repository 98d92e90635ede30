#include "optimizers/shampoo/shampoo.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <stdexcept>

#include "optimizers/common/step_gate.h"

namespace rfsdp {

void check_config(const ShampooConfig& c) {
  check_tiled_config("Shampoo", c);
  if (c.start_preconditioning_step < 1) {
    throw std::invalid_argument("Shampoo: start_preconditioning_step must be a positive integer, got " +
                                std::to_string(c.start_preconditioning_step));
  }
  if (c.start_preconditioning_step < c.precondition_frequency) {
    throw std::invalid_argument(
        "Shampoo: start_preconditioning_step (" + std::to_string(c.start_preconditioning_step) +
        ") must be >= precondition_frequency (" + std::to_string(c.precondition_frequency) +
        "), so that the roots exist when preconditioning starts");
  }
  if (!(c.rank_rtol < 1)) {  // NaN, or every eigenvalue dropped
    throw std::invalid_argument("Shampoo: rank_rtol must be in [0, 1) (None: n * eps(float32) for "
                                "an n x n factor), got " + number_text(c.rank_rtol));
  }
}

void Shampoo::check_options(const ShampooOptions& o) const {
  check_option("Shampoo", "lr", o.lr, o.lr >= 0, ">= 0");
  check_option("Shampoo", "betas[0]", o.beta1, o.beta1 >= 0 && o.beta1 < 1, "in [0, 1)");
  check_option("Shampoo", "betas[1]", o.beta2, o.beta2 >= 0 && o.beta2 <= 1, "in [0, 1]");
  check_option("Shampoo", "epsilon", o.epsilon, o.epsilon >= 0, ">= 0");
  check_option("Shampoo", "grafting_beta2", o.grafting_beta2,
               o.grafting_beta2 >= 0 && o.grafting_beta2 < 1, "in [0, 1)");
  check_option("Shampoo", "grafting_epsilon", o.grafting_epsilon, o.grafting_epsilon > 0, "> 0");
  check_option("Shampoo", "weight_decay", o.weight_decay, o.weight_decay >= 0, ">= 0");
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
  state_.resize(params_.size());
  set_up_tiles(precondition);
}

void Shampoo::clear_moments_and_preconditioner(size_t i) {
  const ParamShard& p = params_[i];
  ParamState& s = state_[i];
  s.m = at::zeros(p.param.sizes(), state_options(i));
  s.v = at::zeros(p.param.sizes(), state_options(i));
  if (!precondition_[i]) return;
  const std::vector<size_t>& tiles = tiles_of(i);
  const auto on = at::TensorOptions().dtype(config_.factor_dtype).device(p.param.device());
  if (config_.basis.coded()) {  // roots start as the identity: Q = I, s = 1
    std::vector<int64_t> rows, cols;
    int64_t sl = 0, sr = 0;
    s.sl.clear();
    s.sr.clear();
    for (size_t k : tiles) {
      s.sl.push_back(sl);
      s.sr.push_back(sr);
      rows.push_back(tiles_[k].rows);
      cols.push_back(tiles_[k].cols);
      sl += tiles_[k].rows;
      sr += tiles_[k].cols;
    }
    const auto f32 = on.dtype(at::kFloat);
    s.q_l = quant::LowbitSquares(rows, config_.basis, f32);
    s.q_r = quant::LowbitSquares(cols, config_.basis, f32);
    for (size_t j = 0; j < tiles.size(); ++j) {
      s.q_l.store(j, at::eye(rows[j], f32));
      s.q_r.store(j, at::eye(cols[j], f32));
    }
    s.s_l = at::ones({sl}, f32);
    s.s_r = at::ones({sr}, f32);
  } else {
    s.root_l = at::zeros_like(factors(i, true));
    s.root_r = at::zeros_like(factors(i, false));
    for (size_t k : tiles) {  // roots start as the identity
      const Tile& t = tiles_[k];
      s.root_l.narrow(0, t.left_offset, packed_size(t.rows)).copy_(pack_symmetric(at::eye(t.rows)));
      s.root_r.narrow(0, t.right_offset, packed_size(t.cols)).copy_(pack_symmetric(at::eye(t.cols)));
    }
  }
  s.failures = at::zeros({static_cast<int64_t>(tiles.size())}, at::kLong);
}

void Shampoo::compute_roots(const std::vector<size_t>& due) {
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
    const ShampooOptions& o = options_of(i);
    const bool correct = config_.use_bias_correction && o.beta2 < 1;
    const double bc = correct ? 1.0 - std::pow(o.beta2, static_cast<double>(param_steps_[i])) : 1.0;
    for (size_t k : tiles_of(i)) {
      const Tile& t = tiles_[k];
      for (bool left : {true, false}) {
        const int64_t d = left ? t.rows : t.cols;
        at::Tensor a = unpack_symmetric(left ? new_left_[k] : new_right_[k], 0, d) / bc;
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
  const bool quantised = config_.basis.bits != 0;
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
      auto& slot = new_roots_[jobs[j].tile];
      NewRoot& r = jobs[j].left ? slot.first : slot.second;
      if (quantised) {
        r.q = eigen[j].first, r.s = eigen[j].second;
      } else {
        r.packed = pack_symmetric(roots[j]);
      }
    }
  }
  root_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (size_t i : due) {
    const std::vector<size_t>& tiles = tiles_of(i);
    for (size_t j = 0; j < tiles.size(); ++j) {
      const size_t k = tiles[j];
      if (failed[k]) {
        if (state_[i].failures.data_ptr<int64_t>()[j] + 1 >= 3) {
          throw std::runtime_error(
              "the inverse roots of " + tile_name(params_[i].name, tiles_[k]) +
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

bool Shampoo::amortises(size_t i) const {
  return precondition_[i] && param_steps_[i] % config_.precondition_frequency == 0;
}

void Shampoo::prepare(const std::vector<size_t>& stepping) {
  // What this step would store, computed before anything changes: the factors of
  // the tiles whose roots are due (packed, in the factor dtype), and their roots.
  new_left_.assign(tiles_.size(), at::Tensor());
  new_right_.assign(tiles_.size(), at::Tensor());
  new_roots_.assign(tiles_.size(), {});
  m_hat_.assign(params_.size(), at::Tensor());
  update_.assign(params_.size(), at::Tensor());
  std::vector<size_t> due;
  for (size_t i : stepping) {
    if (amortises(i)) due.push_back(i);
  }
  if (due.empty()) return;
  for (size_t i : due) {
    for (size_t k : tiles_of(i)) {
      const Tile& tl = tiles_[k];
      new_left_[k] = at::empty({packed_size(tl.rows)}, factors(i, true).options());
      new_right_[k] = at::empty({packed_size(tl.cols)}, factors(i, false).options());
      update_factors(i, k, new_left_[k], new_right_[k]);
    }
  }
  compute_roots(due);
}

bool Shampoo::tiles_step(size_t i) const {
  return precondition_[i] && param_steps_[i] >= config_.start_preconditioning_step;
}

void Shampoo::begin(size_t i) {
  const ShampooOptions& o = options_of(i);
  ParamState& s = state_[i];
  const at::Tensor g = params_[i].grad.view({-1});
  s.v.view({-1}).mul_(o.grafting_beta2).addcmul_(g, g, 1.0 - o.grafting_beta2);
  s.m.view({-1}).mul_(o.beta1).add_(g, 1.0 - o.beta1);
  const std::vector<size_t>& tiles = tiles_of(i);
  if (precondition_[i]) {
    for (size_t j = 0; j < tiles.size(); ++j) {
      const size_t k = tiles[j];
      at::Tensor l = factor(i, k, true), r = factor(i, k, false);
      if (new_left_[k].defined()) {  // due: computed by prepare
        l.copy_(new_left_[k]);
        r.copy_(new_right_[k]);
        // Each side's new root where it succeeded; a failed side keeps its old one.
        const auto& [root_l, root_r] = new_roots_[k];
        if (root_l.defined()) store_root(i, j, true, root_l);
        if (root_r.defined()) store_root(i, j, false, root_r);
        int64_t& f = s.failures.data_ptr<int64_t>()[j];
        f = root_l.defined() && root_r.defined() ? 0 : f + 1;
        new_left_[k] = new_right_[k] = at::Tensor();
        new_roots_[k] = {};
      } else {
        update_factors(i, k, l, r);
      }
    }
  }
  const int64_t t = param_steps_[i];
  const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(t));
  const double bc2g = 1.0 - std::pow(o.grafting_beta2, static_cast<double>(t));
  const at::Tensor m_hat = s.m.view({-1}) / bc1;
  at::Tensor u = m_hat / ((s.v.view({-1}) / bc2g).sqrt_().add_(o.grafting_epsilon));  // D
  if (tiles_step(i)) {
    for (size_t j = 0; j < tiles.size(); ++j) {
      const Tile& tl = tiles_[tiles[j]];
      if (tl.cut < 0) precondition_tile(i, j, tile_view(u, tl), tile_view(m_hat, tl));
    }
  }
  update_[i] = u;
  m_hat_[i] = m_hat;
}

void Shampoo::precondition_tile(size_t i, size_t j, at::Tensor d, const at::Tensor& m_hat) const {
  const at::Tensor rl = root(i, j, true), rr = root(i, j, false);
  const at::Tensor p = at::matmul(at::matmul(rl, m_hat), rr);
  // (tensors, on every device alike: no host wait per tile on a GPU)
  const at::Tensor np = p.norm();
  d.copy_(at::where(np > 0, p * (d.norm() / np), d));
}

// The cut rows' M^ and D to their owners, which precondition their tiles and
// send each holder its rows of the update.
TiledOptimizer::CutRowFields Shampoo::cut_row_fields() const { return {{m_hat_, update_}, {update_}}; }

at::Tensor Shampoo::cut_row_result(const at::Tensor& gathered) const {
  return gathered[1];  // the row's D, preconditioned in place
}

void Shampoo::cut_tile_step(size_t i, size_t j, const at::Tensor& gathered, const at::Tensor& result) {
  const Tile& tl = tiles_[tiles_of(i)[j]];
  precondition_tile(i, j, tile_view(result, tl), tile_view(gathered[0], tl));
}

void Shampoo::finish(size_t i) {
  const ShampooOptions& o = options_of(i);
  params_[i].param.view({-1}).mul_(1.0 - o.lr * o.weight_decay).add_(update_[i], -o.lr);
  m_hat_[i] = update_[i] = at::Tensor();
}

void Shampoo::update_factors(size_t i, size_t k, const at::Tensor& l_out,
                             const at::Tensor& r_out) const {
  const ShampooOptions& o = options_of(i);
  const Tile& tl = tiles_[k];
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
  update(factor(i, k, true), pack_symmetric(at::mm(gt, gt.t())), l_out);
  update(factor(i, k, false), pack_symmetric(at::mm(gt.t(), gt)), r_out);
}

std::vector<std::pair<std::string, at::Tensor>> Shampoo::moments_state(size_t i) const {
  return {{"exp_avg", state_.at(i).m}, {"exp_avg_sq", state_.at(i).v}};
}

std::vector<std::pair<std::string, at::Tensor>> Shampoo::preconditioner_state(size_t i) const {
  const ParamState& s = state_.at(i);
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (config_.basis.bits) {
    out = {{"root_left_basis_codes", s.q_l.codes()}, {"root_left_basis_absmax", s.q_l.absmax()},
           {"root_left_eigenvalues", s.s_l},         {"root_right_basis_codes", s.q_r.codes()},
           {"root_right_basis_absmax", s.q_r.absmax()}, {"root_right_eigenvalues", s.s_r}};
  } else {
    out = {{"root_left", s.root_l}, {"root_right", s.root_r}};
  }
  out.push_back({"root_failures", s.failures});
  return out;
}

// Moments and failure counts as saved; the roots as this one keeps them.
NamedState Shampoo::requantized_own(size_t i, const TiledConfig& saved_config, const NamedState& full,
                                    const TileRange& r) const {
  const quant::LowBitFormat& saved_basis = saved_config.basis;
  const ParamShard& p = params_.at(i);
  NamedState out = saved_as_kept(i, full, {"exp_avg", "exp_avg_sq", "root_failures"});
  for (bool left : {true, false}) {
    const std::string side = left ? "root_left" : "root_right";
    const auto n_of = [left](const Tile& t) { return left ? t.rows : t.cols; };
    std::vector<at::Tensor> qs, ss;  // each root of this rank's tiles as Q diag(s) Q^T, fp32
    if (!saved_basis.coded()) {  // packed roots: their eigh
      const at::Tensor flat = saved(full, side, name(), p).reshape(-1);
      int64_t at = 0;
      for (size_t k = 0; k < r.all.size(); ++k) {
        const int64_t n = n_of(r.all[k]);
        if (k >= r.first && k < r.end) {
          const auto [lam, q] = eigh_in_fp64(unpack_symmetric(flat, at, n));
          qs.push_back(q);
          ss.push_back(lam);
        }
        at += packed_size(n);
      }
    } else {
      qs = decode_squares(full, side + "_basis", r, left, saved_basis, name(), p);
      const at::Tensor s_all = saved(full, side + "_eigenvalues", name(), p).reshape(-1);
      int64_t at = 0;
      for (size_t k = 0; k < r.all.size(); ++k) {
        const int64_t n = n_of(r.all[k]);
        if (k >= r.first && k < r.end) ss.push_back(s_all.narrow(0, at, n).to(at::kFloat));
        at += n;
      }
    }
    if (config_.basis.coded()) {
      encode_squares(qs, side + "_basis", config_.basis, at::kFloat, &out);
      out[side + "_eigenvalues"] = ss.empty() ? at::zeros({0}, at::kFloat) : at::cat(ss);
      continue;
    }
    std::vector<at::Tensor> roots;
    for (size_t j = 0; j < qs.size(); ++j) {
      const at::Tensor q = qs[j].to(at::kDouble);
      roots.push_back(pack_symmetric(at::matmul(q * ss[j].to(at::kDouble).unsqueeze(0), q.t())));
    }
    out[side] = (roots.empty() ? at::zeros({0}) : at::cat(roots)).to(config_.factor_dtype);
  }
  return out;
}

void Shampoo::own_layout(size_t i, const TileRange& r, std::vector<StateLayout>* out) const {
  out->insert(out->end(), {StateLayout::rows("exp_avg"), StateLayout::rows("exp_avg_sq")});
  if (!precondition_[i]) return;
  for (bool left : {true, false}) {
    const auto n = [left](const Tile& t) { return left ? t.rows : t.cols; };
    const std::string side = left ? "left" : "right";
    if (config_.basis.coded()) {
      square_tiles_layout("root_" + side + "_basis", r, left, config_.basis, out);
      out->push_back(tile_sequence("root_" + side + "_eigenvalues", r, n));
    } else {
      out->push_back(tile_sequence("root_" + side, r, [&](const Tile& t) { return packed_size(n(t)); }));
    }
  }
  out->push_back(tile_sequence("root_failures", r, [](const Tile&) { return int64_t{1}; }));
}

at::Tensor Shampoo::root(size_t i, size_t j, bool left) const {
  const ParamState& s = state_.at(i);
  const Tile& tl = tiles_[tiles_of(i).at(j)];
  const int64_t n = left ? tl.rows : tl.cols;
  if (!config_.basis.bits) {
    return unpack_symmetric(left ? s.root_l : s.root_r, left ? tl.left_offset : tl.right_offset, n);
  }
  const at::Tensor q = (left ? s.q_l : s.q_r).orthogonal(j);
  const at::Tensor d = (left ? s.s_l : s.s_r).narrow(0, left ? s.sl[j] : s.sr[j], n);
  return at::matmul(q * d.unsqueeze(0), q.t());
}

void Shampoo::store_root(size_t i, size_t j, bool left, const NewRoot& r) {
  ParamState& s = state_[i];
  const Tile& tl = tiles_[tiles_of(i)[j]];
  const int64_t n = left ? tl.rows : tl.cols;
  if (!config_.basis.bits) {
    (left ? s.root_l : s.root_r).narrow(0, left ? tl.left_offset : tl.right_offset,
                                        packed_size(n)).copy_(r.packed);
    return;
  }
  (left ? s.q_l : s.q_r).store(j, r.q);
  (left ? s.s_l : s.s_r).narrow(0, left ? s.sl[j] : s.sr[j], n).copy_(r.s);
}

int64_t Shampoo::factor_bytes() const {
  int64_t b = 0;
  for (size_t i = 0; i < state_.size(); ++i) {
    const ParamState& s = state_[i];
    for (const at::Tensor* t :
         {&factors(i, true), &factors(i, false), &s.root_l, &s.root_r, &s.s_l, &s.s_r}) {
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
