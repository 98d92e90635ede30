#include "optimizers/soap/soap.h"

#include <ATen/core/grad_mode.h>

#include <cmath>
#include <map>
#include <stdexcept>

#include "optimizers/common/step_gate.h"
#include "quant/blockwise/code_maps.h"
#include "quant/blockwise/cpu_kernels.h"
#include "quant/blockwise/lowbit.h"

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
  // Which matrices of a batch [b, d, d] are finite, on the host: one wait per batch.
  auto finite = [](const at::Tensor& q) {
    return at::isfinite(q).flatten(1).all(1).to(at::kCPU).contiguous();
  };
  auto accept = [&](size_t k, const at::Tensor& q) {
    out[k] = q.flip({-1}).to(at::kFloat).contiguous();  // eigh: ascending
    (*ok)[k] = true;
  };
  bool batched = false;
  try {
    auto [l, q] = at::linalg_eigh(at::stack(a).to(at::kFloat));
    batched = true;
    const at::Tensor fin = finite(q);
    for (size_t k = 0; k < n; ++k) {
      if (fin.data_ptr<bool>()[k]) accept(k, q[k]);
    }
  } catch (const c10::Error&) {
    // Some matrix did not converge: each is tried alone below.
  }
  for (size_t k = 0; k < n; ++k) {
    if ((*ok)[k]) continue;
    if (!batched) {
      try {
        auto [l, q] = at::linalg_eigh(a[k].to(at::kFloat));
        if (finite(q.unsqueeze(0)).data_ptr<bool>()[0]) {
          accept(k, q);
          continue;
        }
      } catch (const c10::Error&) {
      }
    }
    if (retries) ++*retries;
    try {
      auto [l, q] = at::linalg_eigh(a[k].to(at::kDouble));
      if (finite(q.unsqueeze(0)).data_ptr<bool>()[0]) accept(k, q);
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
  for (at::ScalarType d : {config_.factor_dtype, config_.basis_dtype}) {
    if (d != at::kFloat && d != at::kBFloat16) {
      throw std::invalid_argument("SOAP: factor_dtype and basis_dtype must be float32 or bfloat16");
    }
  }
  if (config_.state_dtype != at::kFloat && config_.state_dtype != at::kByte) {
    throw std::invalid_argument("SOAP: state_dtype must be float32 or int8 (8-bit codes)");
  }
  state_dtype_8bit_ = config_.state_dtype == at::kByte;
  if (config_.basis_bits != 0) {
    quant::check_lowbit_format("SOAP", config_.basis_bits, config_.basis_block, config_.basis_map,
                               config_.bjorck_iterations);
  }
  if (state_dtype_8bit_) {
    lut_m_ = quant::code_lut(quant::dynamic_map(true));
    lut_v_ = quant::code_lut(quant::dynamic_map(false), /*keep_nonzero=*/true);  // v: see CodeLut
  }
  check_options(options);
  const size_t n = params_.size();
  if (!precondition.empty() && precondition.size() != n) {
    throw std::invalid_argument("SOAP: " + std::to_string(precondition.size()) +
                                " precondition flags for " + std::to_string(n) + " parameters");
  }
  for (size_t i = 0; i < n; ++i) {
    const ParamShard& p = params_[i];
    precondition_.push_back((precondition.empty() || precondition[i]) && p.shape.size() >= 2);
    ParamState s;
    if (!eight_bit(i)) {
      s.m = at::zeros(p.param.sizes(), state_options(i));
      s.v = at::zeros(p.param.sizes(), state_options(i));
    } else if (p.param.is_cuda()) {
      throw std::invalid_argument("SOAP: parameter '" + p.name + "' is on " + p.param.device().str() +
                                  "; 8-bit moments (state_dtype int8) run on the CPU only so far");
    }
    if (precondition_[i]) {
      int64_t left = 0, right = 0, ql = 0, qr = 0;
      std::vector<int64_t> rows, cols;
      for (const ShampooTile& t : shampoo_tiles("SOAP", p, i, config_.max_preconditioner_dim)) {
        s.tiles.push_back(tiles_.size());
        tiles_.push_back(t);
        s.ql.push_back(ql);
        s.qr.push_back(qr);
        rows.push_back(t.rows);
        cols.push_back(t.cols);
        left += shampoo_packed_size(t.rows);
        right += shampoo_packed_size(t.cols);
        ql += t.rows * t.rows;
        qr += t.cols * t.cols;
      }
      const auto on = at::TensorOptions().device(p.param.device());  // states live with the shard
      s.left = at::zeros({left}, on.dtype(config_.factor_dtype));
      s.right = at::zeros({right}, on.dtype(config_.factor_dtype));
      if (const int bits = config_.basis_bits) {
        s.lq_left = quant::LowbitSquares(rows, bits, config_.basis_block, config_.basis_map,
                                         config_.bjorck_iterations, on);
        s.lq_right = quant::LowbitSquares(cols, bits, config_.basis_block, config_.basis_map,
                                          config_.bjorck_iterations, on);
      } else {
        s.q_left = at::zeros({ql}, on.dtype(config_.basis_dtype));
        s.q_right = at::zeros({qr}, on.dtype(config_.basis_dtype));
      }
      if (eight_bit(i)) {  // zero scales: every code decodes to 0
        int64_t rows = 0;
        for (size_t k : s.tiles) s.arow.push_back(rows), rows += tiles_[k].rows;
        s.mq = at::zeros(p.param.sizes(), at::kByte);
        s.vq = at::zeros(p.param.sizes(), at::kByte);
        s.ma = at::zeros({rows}, at::kFloat);
        s.va = at::zeros({rows}, at::kFloat);
      }
    }
    state_.push_back(std::move(s));
  }
}

at::Tensor SOAP::basis(size_t i, size_t j, bool left) const {
  const ParamState& s = state_[i];
  if (config_.basis_bits) return (left ? s.lq_left : s.lq_right).orthogonal(j);
  const ShampooTile& tl = tiles_[s.tiles[j]];
  const int64_t n = left ? tl.rows : tl.cols;
  return basis_view(left ? s.q_left : s.q_right, left ? s.ql[j] : s.qr[j], n).to(at::kFloat);
}

void SOAP::store_basis(size_t i, size_t j, bool left, const at::Tensor& q) {
  ParamState& s = state_[i];
  if (config_.basis_bits) {
    (left ? s.lq_left : s.lq_right).store(j, q);
    return;
  }
  const ShampooTile& tl = tiles_[s.tiles[j]];
  const int64_t n = left ? tl.rows : tl.cols;
  basis_view(left ? s.q_left : s.q_right, left ? s.ql[j] : s.qr[j], n).copy_(q);
}

at::Tensor SOAP::decode(size_t i, bool second) const {
  const ParamState& s = state_[i];
  const at::Tensor codes = (second ? s.vq : s.mq).view({-1});
  const at::Tensor& absmax = second ? s.va : s.ma;
  const auto& lut = second ? *lut_v_ : *lut_m_;
  at::Tensor out = at::empty({codes.numel()}, at::kFloat);
  for (size_t j = 0; j < s.tiles.size(); ++j) {  // the tiles cover the shard
    const ShampooTile& tl = tiles_[s.tiles[j]];
    const at::Tensor q = shampoo_tile_view(codes, tl).contiguous();
    at::Tensor x = at::empty({tl.rows, tl.cols}, at::kFloat);
    quant::cpu::dequantize(q.data_ptr<uint8_t>(), absmax.data_ptr<float>() + s.arow[j],
                           quant::BlockLayout(quant::BlockShape::blocks(tl.cols), tl.rows, tl.cols),
                           lut, x.data_ptr<float>());
    shampoo_tile_view(out, tl).copy_(x);
  }
  return out;
}

void SOAP::encode(size_t i, bool second, const at::Tensor& flat) {
  ParamState& s = state_[i];
  const at::Tensor codes = (second ? s.vq : s.mq).view({-1});
  at::Tensor& absmax = second ? s.va : s.ma;
  const auto& lut = second ? *lut_v_ : *lut_m_;
  for (size_t j = 0; j < s.tiles.size(); ++j) {
    const ShampooTile& tl = tiles_[s.tiles[j]];
    const at::Tensor x = shampoo_tile_view(flat, tl).contiguous();
    at::Tensor q = at::empty({tl.rows, tl.cols}, at::kByte);
    quant::cpu::quantize(x.data_ptr<float>(),
                         quant::BlockLayout(quant::BlockShape::blocks(tl.cols), tl.rows, tl.cols),
                         lut, q.data_ptr<uint8_t>(), absmax.data_ptr<float>() + s.arow[j]);
    shampoo_tile_view(codes, tl).copy_(q);
  }
}

std::pair<at::Tensor, at::Tensor> SOAP::moments(size_t i) const {
  if (eight_bit(i)) {
    const auto shape = params_.at(i).param.sizes();
    return {decode(i, false).view(shape), decode(i, true).view(shape)};
  }
  return {state_.at(i).m, state_.at(i).v};
}

void SOAP::prepare(const std::vector<size_t>& stepping, std::vector<TileUpdate>* up) {
  // Factors first (every stepping tile), then, batched by size, the first bases
  // by eigh and the refreshed ones by one power step and QR.
  struct Job {
    size_t tile;
    bool left;
    at::Tensor x, q;  // the new factor; (refresh) the basis it refreshes
  };
  std::map<int64_t, std::vector<Job>> first, refresh;
  for (size_t i : stepping) {
    if (!precondition_[i]) continue;
    const ParamState& s = state_[i];
    const double bs = shampoo_beta(options_of(i));
    const int64_t t = param_steps_[i];
    const bool refreshes = t >= 2 && (t - 1) % config_.precondition_frequency == 0;
    const at::Tensor g = params_[i].grad.view({-1});
    for (size_t j = 0; j < s.tiles.size(); ++j) {
      const size_t k = s.tiles[j];
      const ShampooTile& tl = tiles_[k];
      const at::Tensor gt = shampoo_tile_view(g, tl).clone();  // aligned alike on any ranks (Shampoo's)
      TileUpdate& u = (*up)[k];
      u.l = Shampoo::unpack(s.left, tl.left_offset, tl.rows).mul_(bs).add_(at::mm(gt, gt.t()), 1 - bs);
      u.r = Shampoo::unpack(s.right, tl.right_offset, tl.cols).mul_(bs).add_(at::mm(gt.t(), gt), 1 - bs);
      if (refreshes) u.used_l = basis(i, j, true), u.used_r = basis(i, j, false);
      for (bool left : {true, false}) {
        const int64_t d = left ? tl.rows : tl.cols;
        if (t == 1) first[d].push_back({k, left, left ? u.l : u.r, {}});
        if (refreshes) refresh[d].push_back({k, left, left ? u.l : u.r, left ? u.used_l : u.used_r});
      }
    }
  }
  auto where = [&](size_t tile) {
    const ShampooTile& tl = tiles_[tile];
    return "parameter '" + params_[tl.param].name + "' (tile rows [" + std::to_string(tl.row0) +
           ", " + std::to_string(tl.row0 + tl.rows) + ") of matrix " + std::to_string(tl.matrix) + ")";
  };
  for (auto& [d, js] : first) {
    std::vector<at::Tensor> mats;
    for (const Job& j : js) mats.push_back(j.x);
    std::vector<bool> ok;
    const auto qs = descending_eigenvectors(mats, &ok, &fp64_retries_);
    for (size_t j = 0; j < js.size(); ++j) {
      if (!ok[j]) {
        throw std::runtime_error("SOAP: the eigendecomposition of a factor of " + where(js[j].tile) +
                                 " failed in fp32 and fp64");
      }
      (js[j].left ? (*up)[js[j].tile].q_l : (*up)[js[j].tile].q_r) = qs[j];
    }
  }
  for (auto& [d, js] : refresh) {
    std::vector<at::Tensor> xs, qs;
    for (const Job& j : js) {
      xs.push_back(j.x);
      qs.push_back(j.q);
    }
    const at::Tensor x = at::stack(xs), q = at::stack(qs);  // [b, d, d]
    // diag(Q^T X Q), column c: sum over r of Q[r, c] (X Q)[r, c].
    const at::Tensor est = (q * at::bmm(x, q)).sum(1);
    const at::Tensor order = at::argsort(est, /*stable=*/true, /*dim=*/1, /*descending=*/true);
    const at::Tensor sorted = at::gather(q, 2, order.unsqueeze(1).expand({-1, d, -1}));
    const at::Tensor qn = std::get<0>(at::linalg_qr(at::bmm(x, sorted)));
    const at::Tensor fin = at::isfinite(qn).flatten(1).all(1).to(at::kCPU).contiguous();
    for (size_t j = 0; j < js.size(); ++j) {
      if (!fin.data_ptr<bool>()[j]) {
        throw std::runtime_error("SOAP: the basis refresh of " + where(js[j].tile) +
                                 " is not finite (check the gradients)");
      }
      TileUpdate& u = (*up)[js[j].tile];
      (js[j].left ? u.q_l : u.q_r) = qn[j];
      (js[j].left ? u.order_l : u.order_r) = order[j];
    }
  }
}

void SOAP::run_step(StepGate& gate, const std::vector<size_t>& stepping) {
  at::NoGradGuard no_grad;
  std::vector<TileUpdate> up(tiles_.size());
  for (size_t i : stepping) {  // no eigh or QR of NaN gradients
    const int64_t t = param_steps_[i];
    if (precondition_[i] && (t == 1 || (t - 1) % config_.precondition_frequency == 0)) {
      gate.check_device_now();
      break;
    }
  }
  if (!gate.failed()) gate.guard([&] { prepare(stepping, &up); });
  gate.agree();  // every rank can take the step: from here on it changes state
  for (size_t i : stepping) {
    const SOAPOptions& o = options_of(i);
    ParamState& s = state_[i];
    const int64_t t = param_steps_[i];
    const at::Tensor g = params_[i].grad.view({-1});
    // 8-bit: the moments decoded, updated below in fp32, encoded at the end.
    const bool coded = eight_bit(i) && t >= 2;
    const at::Tensor m = coded ? decode(i, false) : eight_bit(i) ? at::Tensor() : s.m.view({-1});
    const at::Tensor v = coded ? decode(i, true) : eight_bit(i) ? at::Tensor() : s.v.view({-1});
    if (t >= 2) {
      const int64_t steps = t - 1;
      m.mul_(o.beta1).add_(g, 1 - o.beta1);
      at::Tensor n;
      if (precondition_[i]) {
        n = at::empty_like(g);
        for (size_t j = 0; j < s.tiles.size(); ++j) {
          const size_t k = s.tiles[j];
          const ShampooTile& tl = tiles_[k];
          const at::Tensor ql = up[k].used_l.defined() ? up[k].used_l : basis(i, j, true);
          const at::Tensor qr = up[k].used_r.defined() ? up[k].used_r : basis(i, j, false);
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
      if (u.q_l.defined()) store_basis(i, j, true, u.q_l);
      if (u.q_r.defined()) store_basis(i, j, false, u.q_r);
      if (u.order_l.defined()) {  // a refresh: v follows its basis' new column order
        at::Tensor vt = shampoo_tile_view(v, tl);
        vt.copy_(vt.index_select(0, u.order_l).index_select(1, u.order_r));
      }
    }
    if (coded) {  // (v permuted in fp32 first: the same codes as permuting codes and scales)
      encode(i, false, m);
      encode(i, true, v);
    }
  }
}

std::vector<std::pair<std::string, at::Tensor>> SOAP::state(size_t i) const {
  const ParamState& s = state_.at(i);
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (eight_bit(i)) {
    out = {{"exp_avg_codes", s.mq}, {"exp_avg_absmax", s.ma},
           {"exp_avg_sq_codes", s.vq}, {"exp_avg_sq_absmax", s.va}};
  } else {
    out = {{"exp_avg", s.m}, {"exp_avg_sq", s.v}};
  }
  if (precondition_[i]) {
    out.insert(out.end(), {{"factor_left", s.left}, {"factor_right", s.right}});
    if (config_.basis_bits) {
      out.insert(out.end(), {{"basis_left_codes", s.lq_left.codes()},
                             {"basis_left_absmax", s.lq_left.absmax()},
                             {"basis_right_codes", s.lq_right.codes()},
                             {"basis_right_absmax", s.lq_right.absmax()}});
    } else {
      out.insert(out.end(), {{"basis_left", s.q_left}, {"basis_right", s.q_right}});
    }
  }
  return out;
}

}  // namespace rfsdp
