#include "optimizers/shampoo/shampoo.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <stdexcept>

#include "optimizers/common/step_gate.h"

namespace rfsdp {

void check_config(const ShampooConfig& c) {
  for (const auto& [name, v] : {std::pair<const char*, int64_t>{"max_preconditioner_dim", c.max_preconditioner_dim},
                                {"precondition_frequency", c.precondition_frequency},
                                {"start_preconditioning_step", c.start_preconditioning_step}}) {
    if (v < 1) {
      throw std::invalid_argument(std::string("Shampoo: ") + name +
                                  " must be a positive integer, got " + std::to_string(v));
    }
  }
  if (c.start_preconditioning_step < c.precondition_frequency) {
    throw std::invalid_argument(
        "Shampoo: start_preconditioning_step (" + std::to_string(c.start_preconditioning_step) +
        ") must be >= precondition_frequency (" + std::to_string(c.precondition_frequency) +
        "), so that the roots exist when preconditioning starts");
  }
  if (c.factor_dtype != at::kFloat && c.factor_dtype != at::kBFloat16) {
    throw std::invalid_argument("Shampoo: factor_dtype must be torch.float32 or torch.bfloat16");
  }
  if (!(c.rank_rtol < 1)) {  // NaN, or every eigenvalue dropped
    throw std::invalid_argument("Shampoo: rank_rtol must be in [0, 1) (None: n * eps(float32) for "
                                "an n x n factor), got " + number_text(c.rank_rtol));
  }
  c.basis.check("Shampoo");
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
  const size_t n = params_.size();
  if (!precondition.empty() && precondition.size() != n) {
    throw std::invalid_argument("Shampoo: " + std::to_string(precondition.size()) +
                                " precondition flags for " + std::to_string(n) + " parameters");
  }
  for (size_t i = 0; i < n; ++i) {
    const ParamShard& p = params_[i];
    precondition_.push_back((precondition.empty() || precondition[i]) && p.shape.size() >= 2);
    ParamState s;
    if (precondition_[i]) {
      const int rank = comm_ ? comm_->rank() : 0;
      for (const Tile& t : matrix_tiles("Shampoo", p, i, config_.max_preconditioner_dim, rank, &cut_)) {
        s.tiles.push_back(tiles_.size());
        tiles_.push_back(t);
      }
    }
    state_.push_back(std::move(s));
    Shampoo::clear_state(i);  // (allocates it)
  }
  exchange_ = cut_exchange("Shampoo", cut_, params_, comm_.get());
}

void Shampoo::clear_state(size_t i) {
  const ParamShard& p = params_[i];
  ParamState& s = state_[i];
  s.m = at::zeros(p.param.sizes(), state_options(i));
  s.v = at::zeros(p.param.sizes(), state_options(i));
  if (!precondition_[i]) return;
  int64_t left = 0, right = 0;
  for (size_t k : s.tiles) {
    left += packed_size(tiles_[k].rows);
    right += packed_size(tiles_[k].cols);
  }
  const auto on = at::TensorOptions().dtype(config_.factor_dtype).device(p.param.device());
  s.left = at::zeros({left}, on);  // factors live with the shard
  s.right = at::zeros({right}, on);
  if (config_.basis.coded()) {  // roots start as the identity: Q = I, s = 1
    std::vector<int64_t> rows, cols;
    int64_t sl = 0, sr = 0;
    s.sl.clear();
    s.sr.clear();
    for (size_t k : s.tiles) {
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
      const Tile& t = tiles_[k];
      s.root_l.narrow(0, t.left_offset, packed_size(t.rows)).copy_(pack_symmetric(at::eye(t.rows)));
      s.root_r.narrow(0, t.right_offset, packed_size(t.cols)).copy_(pack_symmetric(at::eye(t.cols)));
    }
  }
  s.failures = at::zeros({static_cast<int64_t>(s.tiles.size())}, at::kLong);
}

at::Tensor Shampoo::grad_tile(size_t i, const Tile& t) const {
  return tile_view(t.cut >= 0 ? cut_g_[t.cut] : params_[i].grad.view({-1}), t);
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
      const Tile& t = tiles_[k];
      for (bool left : {true, false}) {
        const int64_t d = left ? t.rows : t.cols;
        at::Tensor a = unpack_symmetric(left ? new_left[k] : new_right[k], 0, d) / bc;
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
      auto& slot = (*new_roots)[jobs[j].tile];
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
    const ParamState& s = state_[i];
    for (size_t j = 0; j < s.tiles.size(); ++j) {
      const size_t k = s.tiles[j];
      if (failed[k]) {
        if (s.failures.data_ptr<int64_t>()[j] + 1 >= 3) {
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
  cut_g_ = gather_cut_grads(exchange_, cut_, params_, stepping, comm_.get(), gate);
  std::vector<at::Tensor> new_left(tiles_.size()), new_right(tiles_.size());
  std::vector<std::pair<NewRoot, NewRoot>> new_roots(tiles_.size());
  if (!due.empty()) {
    gate.check_device_now();  // no roots of NaN gradients (counted as root failures)
    if (!gate.failed()) {
      gate.guard([&] {
        for (size_t i : due) {
          for (size_t k : state_[i].tiles) {
            const Tile& tl = tiles_[k];
            new_left[k] = at::empty({packed_size(tl.rows)}, state_[i].left.options());
            new_right[k] = at::empty({packed_size(tl.cols)}, state_[i].right.options());
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
        const Tile& tl = tiles_[k];
        at::Tensor l = s.left.narrow(0, tl.left_offset, packed_size(tl.rows));
        at::Tensor r = s.right.narrow(0, tl.right_offset, packed_size(tl.cols));
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
    const at::Tensor p = at::matmul(at::matmul(rl, m_hat), rr);
    // (tensors, on every device alike: no host wait per tile on a GPU)
    const at::Tensor np = p.norm();
    d.copy_(at::where(np > 0, p * (d.norm() / np), d));
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
        const Tile& tl = tiles_[s.tiles[j]];
        if (tl.cut < 0) {
          precondition_tile(i, j, tile_view(u, tl), tile_view(m_hat, tl));
        }
      }
    }
    update[i] = u;
    m_hats[i] = m_hat;
  }
  if (!cut_.empty()) {
    // The cut rows' M^ and D to their owners, which precondition their tiles
    // and send each holder its rows of the update.
    std::vector<at::Tensor> m_in(params_.size()), d_in(params_.size());
    for (size_t i : stepping) m_in[i] = m_hats[i], d_in[i] = update[i];
    const std::vector<at::Tensor> md = exchange_.gather(comm_.get(), {m_in, d_in});
    std::vector<at::Tensor> cut_d(cut_.size());  // at the owner: the row's D, preconditioned in place
    for (size_t j = 0; j < cut_.size(); ++j) {
      if (exchange_.owns(j)) cut_d[j] = md[j][1];
    }
    for (size_t i : stepping) {
      if (!preconditions(i)) continue;
      const ParamState& s = state_[i];
      for (size_t j = 0; j < s.tiles.size(); ++j) {
        const Tile& tl = tiles_[s.tiles[j]];
        if (tl.cut >= 0) {
          precondition_tile(i, j, tile_view(cut_d[tl.cut], tl), tile_view(md[tl.cut][0], tl));
        }
      }
    }
    exchange_.scatter(comm_.get(), cut_d, {d_in});
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
  update(s.left.narrow(0, tl.left_offset, packed_size(tl.rows)), pack_symmetric(at::mm(gt, gt.t())),
         l_out);
  update(s.right.narrow(0, tl.right_offset, packed_size(tl.cols)), pack_symmetric(at::mm(gt.t(), gt)),
         r_out);
}

std::vector<std::pair<std::string, at::Tensor>> Shampoo::state(size_t i) const {
  const ParamState& s = state_.at(i);
  std::vector<std::pair<std::string, at::Tensor>> out{{"exp_avg", s.m}, {"exp_avg_sq", s.v}};
  if (precondition_[i]) {
    out.insert(out.end(), {{"factor_left", s.left}, {"factor_right", s.right}});
    if (config_.basis.bits) {
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

NamedState Shampoo::requantized_state(size_t i, const ShampooConfig& saved_config,
                                      const NamedState& full) const {
  const ParamShard& p = params_.at(i);
  if (!precondition_.at(i)) return saved_as_kept(i, full, {"exp_avg", "exp_avg_sq"});
  // Moments, factors and failure counts as saved; the roots as this one keeps them.
  NamedState out = saved_as_kept(
      i, full, {"exp_avg", "exp_avg_sq", "factor_left", "factor_right", "root_failures"});
  const TileRange r = tile_range(p, config_.max_preconditioner_dim);
  for (bool left : {true, false}) {
    const std::string side = left ? "root_left" : "root_right";
    const auto n_of = [left](const Tile& t) { return left ? t.rows : t.cols; };
    std::vector<at::Tensor> qs, ss;  // each root of this rank's tiles as Q diag(s) Q^T, fp32
    if (!saved_config.basis.coded()) {  // packed roots: their eigh
      const at::Tensor flat = saved(full, side, name(), p).reshape(-1);
      int64_t at = 0;
      for (size_t k = 0; k < r.all.size(); ++k) {
        const int64_t n = n_of(r.all[k]);
        if (k >= r.first && k < r.end) {
          const auto [lam, q] = at::linalg_eigh(unpack_symmetric(flat, at, n).to(at::kDouble));
          qs.push_back(q.to(at::kFloat));
          ss.push_back(lam.to(at::kFloat));
        }
        at += packed_size(n);
      }
    } else {
      qs = decode_squares(full, side + "_basis", r, left, saved_config.basis, name(), p);
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

std::vector<StateLayout> Shampoo::state_layout(size_t i) const {
  std::vector<StateLayout> out{StateLayout::rows("exp_avg"), StateLayout::rows("exp_avg_sq")};
  if (!precondition_.at(i)) return out;
  const TileRange r = tile_range(params_.at(i), config_.max_preconditioner_dim);
  for (bool left : {true, false}) {
    const auto n = [left](const Tile& t) { return left ? t.rows : t.cols; };
    const std::string side = left ? "left" : "right";
    out.push_back(tile_sequence("factor_" + side, r, [&](const Tile& t) { return packed_size(n(t)); }));
    if (config_.basis.coded()) {
      square_tiles_layout("root_" + side + "_basis", r, left, config_.basis, &out);
      out.push_back(tile_sequence("root_" + side + "_eigenvalues", r, n));
    } else {
      out.push_back(tile_sequence("root_" + side, r, [&](const Tile& t) { return packed_size(n(t)); }));
    }
  }
  out.push_back(tile_sequence("root_failures", r, [](const Tile&) { return int64_t{1}; }));
  return out;
}

at::Tensor Shampoo::root(size_t i, size_t j, bool left) const {
  const ParamState& s = state_.at(i);
  const Tile& tl = tiles_[s.tiles.at(j)];
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
  const Tile& tl = tiles_[s.tiles[j]];
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
