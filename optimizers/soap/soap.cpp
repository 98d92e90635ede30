#include "optimizers/soap/soap.h"

#include <ATen/core/grad_mode.h>

#include <cmath>
#include <map>
#include <stdexcept>

#include "optimizers/common/step_gate.h"

namespace rfsdp {

namespace {

// The n x n basis at `offset` of flat storage (a view).
at::Tensor basis_view(const at::Tensor& flat, int64_t offset, int64_t n) {
  return flat.narrow(0, offset, n * n).view({n, n});
}

}  // namespace

std::vector<at::Tensor> descending_eigenvectors(const std::vector<at::Tensor>& a,
                                                std::vector<bool>* ok, int64_t* retries) {
  const size_t n = a.size();
  std::vector<at::Tensor> out(n);
  ok->assign(n, false);
  if (n == 0) return out;
  auto accept = [&](size_t k, const at::Tensor& q) {
    if (!at::isfinite(q).all().item<bool>()) return false;
    out[k] = q.flip({-1}).to(at::kFloat).contiguous();  // eigh: ascending
    (*ok)[k] = true;
    return true;
  };
  bool batched = false;
  try {
    auto [l, q] = at::linalg_eigh(at::stack(a).to(at::kFloat));
    batched = true;
    for (size_t k = 0; k < n; ++k) accept(k, q[k]);
  } catch (const c10::Error&) {
    // Some matrix did not converge: each is tried alone below.
  }
  for (size_t k = 0; k < n; ++k) {
    if ((*ok)[k]) continue;
    if (!batched) {
      try {
        auto [l, q] = at::linalg_eigh(a[k].to(at::kFloat));
        if (accept(k, q)) continue;
      } catch (const c10::Error&) {
      }
    }
    if (retries) ++*retries;
    try {
      auto [l, q] = at::linalg_eigh(a[k].to(at::kDouble));
      accept(k, q);
    } catch (const c10::Error&) {
    }
  }
  return out;
}

void SOAP::check_options(const SOAPOptions& o) const {
  const double bs = o.shampoo_beta < 0 ? o.beta2 : o.shampoo_beta;
  if (!(o.lr >= 0) || !(o.beta1 >= 0 && o.beta1 < 1) || !(o.beta2 >= 0 && o.beta2 < 1) ||
      !(bs >= 0 && bs < 1) || !(o.eps > 0) || !(o.weight_decay >= 0)) {
    throw std::invalid_argument(
        "SOAP: need lr >= 0, 0 <= betas < 1, 0 <= shampoo_beta < 1 (negative: betas[1]), "
        "eps > 0, weight_decay >= 0; got lr=" + std::to_string(o.lr) + ", betas=(" +
        std::to_string(o.beta1) + ", " + std::to_string(o.beta2) + "), shampoo_beta=" +
        std::to_string(o.shampoo_beta) + ", eps=" + std::to_string(o.eps) +
        ", weight_decay=" + std::to_string(o.weight_decay));
  }
}

SOAP::SOAP(std::vector<ParamShard> params, SOAPOptions options, SOAPConfig config,
           std::shared_ptr<Comm> comm, std::vector<bool> precondition)
    : GroupedOptimizer("SOAP", std::move(params), std::move(comm), config.check_finite, options),
      config_(config) {
  if (config_.max_preconditioner_dim < 1) {
    throw std::invalid_argument("SOAP: max_preconditioner_dim must be >= 1");
  }
  if (config_.precondition_frequency < 1) {
    throw std::invalid_argument("SOAP: precondition_frequency must be >= 1");
  }
  check_options(options);
  const size_t n = params_.size();
  if (!precondition.empty() && precondition.size() != n) {
    throw std::invalid_argument("SOAP: " + std::to_string(precondition.size()) +
                                " precondition flags for " + std::to_string(n) + " parameters");
  }
  for (size_t i = 0; i < n; ++i) {
    const ParamShard& p = params_[i];
    if (p.param.is_cuda()) {
      throw std::invalid_argument("SOAP: parameter '" + p.name + "' is on " +
                                  p.param.device().str() + "; SOAP runs on the CPU only so far");
    }
    precondition_.push_back((precondition.empty() || precondition[i]) && p.shape.size() >= 2);
    ParamState s;
    s.m = at::zeros_like(p.param);
    s.v = at::zeros_like(p.param);
    if (precondition_[i]) {
      int64_t left = 0, right = 0, ql = 0, qr = 0;
      for (const ShampooTile& t : shampoo_tiles(p, i, config_.max_preconditioner_dim)) {
        s.tiles.push_back(tiles_.size());
        tiles_.push_back(t);
        s.ql.push_back(ql);
        s.qr.push_back(qr);
        left += shampoo_packed_size(t.rows);
        right += shampoo_packed_size(t.cols);
        ql += t.rows * t.rows;
        qr += t.cols * t.cols;
      }
      s.left = at::zeros({left}, at::kFloat);
      s.right = at::zeros({right}, at::kFloat);
      s.q_left = at::zeros({ql}, at::kFloat);
      s.q_right = at::zeros({qr}, at::kFloat);
    }
    state_.push_back(std::move(s));
  }
}

void SOAP::prepare(const std::vector<size_t>& stepping, std::vector<TileUpdate>* up) {
  // Factors first (every stepping tile), then the first bases by eigh, batched
  // by size, and the refreshed ones by one power step and QR.
  struct Job {
    size_t tile;
    bool left;
  };
  std::map<int64_t, std::vector<Job>> jobs;
  std::map<int64_t, std::vector<at::Tensor>> mats;
  for (size_t i : stepping) {
    if (!precondition_[i]) continue;
    const ParamState& s = state_[i];
    const SOAPOptions& o = options_of(i);
    const double bs = shampoo_beta(o);
    const int64_t t = param_steps_[i];
    const at::Tensor g = params_[i].grad.view({-1});
    for (size_t j = 0; j < s.tiles.size(); ++j) {
      const size_t k = s.tiles[j];
      const ShampooTile& tl = tiles_[k];
      const at::Tensor gt = shampoo_tile_view(g, tl);
      TileUpdate& u = (*up)[k];
      u.l = Shampoo::unpack(s.left, tl.left_offset, tl.rows).mul_(bs).add_(at::mm(gt, gt.t()), 1 - bs);
      u.r = Shampoo::unpack(s.right, tl.right_offset, tl.cols).mul_(bs).add_(at::mm(gt.t(), gt), 1 - bs);
      if (t == 1) {
        for (bool left : {true, false}) {
          const int64_t d = left ? tl.rows : tl.cols;
          jobs[d].push_back({k, left});
          mats[d].push_back(left ? u.l : u.r);
        }
      } else if ((t - 1) % config_.precondition_frequency == 0) {
        for (bool left : {true, false}) {
          const at::Tensor x = left ? u.l : u.r;
          const int64_t d = left ? tl.rows : tl.cols;
          const at::Tensor q = basis_view(left ? s.q_left : s.q_right, left ? s.ql[j] : s.qr[j], d);
          const at::Tensor est = at::mm(q.t(), at::mm(x, q)).diagonal();
          const at::Tensor order = at::argsort(est, /*stable=*/true, /*dim=*/0, /*descending=*/true);
          const at::Tensor qn = std::get<0>(at::linalg_qr(at::mm(x, q.index_select(1, order))));
          if (!at::isfinite(qn).all().item<bool>()) {
            throw std::runtime_error("SOAP: the basis refresh of parameter '" + params_[i].name +
                                     "' is not finite (check the gradients)");
          }
          (left ? u.q_l : u.q_r) = qn.contiguous();
          (left ? u.order_l : u.order_r) = order;
        }
      }
    }
  }
  for (auto& [d, js] : jobs) {
    std::vector<bool> ok;
    const auto qs = descending_eigenvectors(mats[d], &ok, &fp64_retries_);
    for (size_t j = 0; j < js.size(); ++j) {
      if (!ok[j]) {
        const ShampooTile& tl = tiles_[js[j].tile];
        throw std::runtime_error(
            "SOAP: the eigendecomposition of a factor of parameter '" + params_[tl.param].name +
            "' (tile rows [" + std::to_string(tl.row0) + ", " + std::to_string(tl.row0 + tl.rows) +
            ") of matrix " + std::to_string(tl.matrix) + ") failed in fp32 and fp64");
      }
      (js[j].left ? (*up)[js[j].tile].q_l : (*up)[js[j].tile].q_r) = qs[j];
    }
  }
}

void SOAP::run_step(StepGate& gate, const std::vector<size_t>& stepping) {
  at::NoGradGuard no_grad;
  std::vector<TileUpdate> up(tiles_.size());
  if (!gate.failed()) gate.guard([&] { prepare(stepping, &up); });
  gate.agree();  // every rank can take the step: from here on it changes state
  for (size_t i : stepping) {
    const SOAPOptions& o = options_of(i);
    ParamState& s = state_[i];
    const int64_t t = param_steps_[i];
    const at::Tensor g = params_[i].grad.view({-1});
    const at::Tensor m = s.m.view({-1}), v = s.v.view({-1});
    if (t >= 2) {
      const int64_t steps = t - 1;
      m.mul_(o.beta1).add_(g, 1 - o.beta1);
      at::Tensor n;
      if (precondition_[i]) {
        n = at::empty_like(g);
        for (size_t j = 0; j < s.tiles.size(); ++j) {
          const ShampooTile& tl = tiles_[s.tiles[j]];
          const at::Tensor ql = basis_view(s.q_left, s.ql[j], tl.rows);
          const at::Tensor qr = basis_view(s.q_right, s.qr[j], tl.cols);
          const at::Tensor gp = at::mm(at::mm(ql.t(), shampoo_tile_view(g, tl)), qr);
          at::Tensor vt = shampoo_tile_view(v, tl);
          vt.mul_(o.beta2).addcmul_(gp, gp, 1 - o.beta2);
          const at::Tensor mp = at::mm(at::mm(ql.t(), shampoo_tile_view(m, tl)), qr);
          shampoo_tile_view(n, tl).copy_(at::mm(at::mm(ql, mp / (vt.sqrt() + o.eps)), qr.t()));
        }
      } else {
        v.mul_(o.beta2).addcmul_(g, g, 1 - o.beta2);
        n = m / (v.sqrt() + o.eps);
      }
      const double step =
          config_.correct_bias
              ? o.lr * std::sqrt(1 - std::pow(o.beta2, static_cast<double>(steps))) /
                    (1 - std::pow(o.beta1, static_cast<double>(steps)))
              : o.lr;
      params_[i].param.view({-1}).add_(n, -step).mul_(1 - o.lr * o.weight_decay);
    }
    if (!precondition_[i]) continue;
    for (size_t j = 0; j < s.tiles.size(); ++j) {
      const size_t k = s.tiles[j];
      const ShampooTile& tl = tiles_[k];
      const TileUpdate& u = up[k];
      s.left.narrow(0, tl.left_offset, shampoo_packed_size(tl.rows)).copy_(Shampoo::pack(u.l));
      s.right.narrow(0, tl.right_offset, shampoo_packed_size(tl.cols)).copy_(Shampoo::pack(u.r));
      if (u.q_l.defined()) basis_view(s.q_left, s.ql[j], tl.rows).copy_(u.q_l);
      if (u.q_r.defined()) basis_view(s.q_right, s.qr[j], tl.cols).copy_(u.q_r);
      if (u.order_l.defined()) {  // a refresh: v follows its basis' new column order
        at::Tensor vt = shampoo_tile_view(v, tl);
        vt.copy_(vt.index_select(0, u.order_l).index_select(1, u.order_r));
      }
    }
  }
}

std::vector<std::pair<std::string, at::Tensor>> SOAP::state(size_t i) const {
  const ParamState& s = state_.at(i);
  std::vector<std::pair<std::string, at::Tensor>> out{{"exp_avg", s.m}, {"exp_avg_sq", s.v}};
  if (precondition_[i]) {
    out.insert(out.end(), {{"factor_left", s.left},
                           {"factor_right", s.right},
                           {"basis_left", s.q_left},
                           {"basis_right", s.q_right}});
  }
  return out;
}

int64_t SOAP::state_bytes() const {
  int64_t b = 0;
  for (const auto& s : state_) {
    for (const at::Tensor* t : {&s.m, &s.v, &s.left, &s.right, &s.q_left, &s.q_right}) {
      if (t->defined()) b += t->nbytes();
    }
  }
  return b;
}

}  // namespace rfsdp
