#include "optimizers/soap/soap.h"

#include <ATen/core/grad_mode.h>

#include <cmath>
#include <map>
#include <stdexcept>

#include "optimizers/common/step_gate.h"
#include "quant/ops.h"

namespace rfsdp {

namespace {

// The n x n basis at `offset` of flat storage (a view).
at::Tensor basis_view(const at::Tensor& flat, int64_t offset, int64_t n) {
  return flat.narrow(0, offset, n * n).view({n, n});
}

}  // namespace

void SOAP::check_options(const SOAPOptions& o) const {
  check_option("SOAP", "lr", o.lr, o.lr >= 0, ">= 0");
  check_option("SOAP", "betas[0]", o.beta1, o.beta1 >= 0 && o.beta1 < 1, "in [0, 1)");
  check_option("SOAP", "betas[1]", o.beta2, o.beta2 >= 0 && o.beta2 < 1, "in [0, 1)");
  check_option("SOAP", "shampoo_beta", o.shampoo_beta, o.shampoo_beta < 1,
               "in [0, 1) (negative: betas[1])");
  check_option("SOAP", "eps", o.eps, o.eps > 0, "> 0");
  check_option("SOAP", "weight_decay", o.weight_decay, o.weight_decay >= 0, ">= 0");
}

void check_config(const SOAPConfig& c) {
  for (const auto& [name, v] : {std::pair<const char*, int64_t>{"max_preconditioner_dim", c.max_preconditioner_dim},
                                {"precondition_frequency", c.precondition_frequency}}) {
    if (v < 1) {
      throw std::invalid_argument(std::string("SOAP: ") + name + " must be a positive integer, got " +
                                  std::to_string(v));
    }
  }
  if (c.factor_dtype != at::kFloat && c.factor_dtype != at::kBFloat16) {
    throw std::invalid_argument("SOAP: factor_dtype must be torch.float32 or torch.bfloat16");
  }
  if (!c.basis.coded() && c.basis_dtype != at::kFloat && c.basis_dtype != at::kBFloat16) {
    throw std::invalid_argument("SOAP: basis_dtype must be torch.float32, torch.bfloat16, \"int8\" "
                                "or \"int4\"");
  }
  if (c.state_dtype != at::kFloat && c.state_dtype != at::kByte) {
    throw std::invalid_argument("SOAP: state_dtype must be torch.float32 or \"int8\" (8-bit codes)");
  }
  c.basis.check("SOAP");
}

SOAP::SOAP(std::vector<ParamShard> params, SOAPOptions options, SOAPConfig config,
           std::shared_ptr<Comm> comm, std::vector<bool> precondition)
    : GroupedOptimizer("SOAP", std::move(params), std::move(comm), config.check_finite, options),
      config_(config) {
  check_config(config_);
  state_dtype_8bit_ = config_.state_dtype == at::kByte;
  if (state_dtype_8bit_) {
    code_m_ = quant::Codec(quant::dynamic_map(true));
    code_v_ = quant::Codec(quant::dynamic_map(false), /*keep_nonzero=*/true);  // v: see CodeLut
  }
  check_options(options);
  const size_t n = params_.size();
  if (!precondition.empty() && precondition.size() != n) {
    throw std::invalid_argument("SOAP: " + std::to_string(precondition.size()) +
                                " precondition flags for " + std::to_string(n) + " parameters");
  }
  const int rank = comm_ ? comm_->rank() : 0;
  for (size_t i = 0; i < n; ++i) {
    const ParamShard& p = params_[i];
    precondition_.push_back((precondition.empty() || precondition[i]) && p.shape.size() >= 2);
    ParamState s;
    if (precondition_[i]) {
      int64_t ql = 0, qr = 0, arow = 0;
      for (const Tile& t : matrix_tiles("SOAP", p, i, config_.max_preconditioner_dim, rank, &cut_)) {
        s.tiles.push_back(tiles_.size());
        tiles_.push_back(t);
        s.ql.push_back(ql);
        s.qr.push_back(qr);
        ql += t.rows * t.rows;
        qr += t.cols * t.cols;
        if (eight_bit(i)) s.arow.push_back(arow), arow += t.rows;
      }
    }
    state_.push_back(std::move(s));
    SOAP::clear_state(i);  // (allocates it)
  }
  exchange_ = cut_exchange("SOAP", cut_, params_, comm_.get());
}

void SOAP::clear_state(size_t i) {
  const ParamShard& p = params_[i];
  ParamState& s = state_[i];
  if (!eight_bit(i)) {
    s.m = at::zeros(p.param.sizes(), state_options(i));
    s.v = at::zeros(p.param.sizes(), state_options(i));
  }
  if (!precondition_[i]) return;
  int64_t left = 0, right = 0, ql = 0, qr = 0, rows_total = 0;
  std::vector<int64_t> rows, cols;
  for (size_t k : s.tiles) {
    const Tile& t = tiles_[k];
    rows.push_back(t.rows);
    cols.push_back(t.cols);
    left += packed_size(t.rows);
    right += packed_size(t.cols);
    ql += t.rows * t.rows;
    qr += t.cols * t.cols;
    rows_total += t.rows;
  }
  const auto on = at::TensorOptions().device(p.param.device());  // states live with the shard
  s.left = at::zeros({left}, on.dtype(config_.factor_dtype));
  s.right = at::zeros({right}, on.dtype(config_.factor_dtype));
  if (config_.basis.coded()) {
    s.lq_left = quant::LowbitSquares(rows, config_.basis, on);
    s.lq_right = quant::LowbitSquares(cols, config_.basis, on);
  } else {
    s.q_left = at::zeros({ql}, on.dtype(config_.basis_dtype));
    s.q_right = at::zeros({qr}, on.dtype(config_.basis_dtype));
  }
  if (eight_bit(i)) {  // zero scales: every code decodes to 0
    s.mq = at::zeros(p.param.sizes(), on.dtype(at::kByte));
    s.vq = at::zeros(p.param.sizes(), on.dtype(at::kByte));
    s.ma = at::zeros({rows_total}, on.dtype(at::kFloat));
    s.va = at::zeros({rows_total}, on.dtype(at::kFloat));
  }
}

at::Tensor SOAP::basis(size_t i, size_t j, bool left) const {
  const ParamState& s = state_[i];
  if (config_.basis.bits) return (left ? s.lq_left : s.lq_right).orthogonal(j);
  const Tile& tl = tiles_[s.tiles[j]];
  const int64_t n = left ? tl.rows : tl.cols;
  return basis_view(left ? s.q_left : s.q_right, left ? s.ql[j] : s.qr[j], n).to(at::kFloat);
}

void SOAP::store_basis(size_t i, size_t j, bool left, const at::Tensor& q) {
  ParamState& s = state_[i];
  if (config_.basis.bits) {
    (left ? s.lq_left : s.lq_right).store(j, q);
    return;
  }
  const Tile& tl = tiles_[s.tiles[j]];
  const int64_t n = left ? tl.rows : tl.cols;
  basis_view(left ? s.q_left : s.q_right, left ? s.ql[j] : s.qr[j], n).copy_(q);
}

// The 8-bit moments: one block per row of each tile (its absmax at arow + row).
// codes: flat, laid out as the tile's shard (or, a cut row's tile, as the row's buffer).
void SOAP::decode_tile(size_t i, size_t j, bool second, const at::Tensor& codes,
                       const at::Tensor& out) const {
  const ParamState& s = state_[i];
  const Tile& tl = tiles_[s.tiles[j]];
  const at::Tensor& absmax = second ? s.va : s.ma;
  at::Tensor x = at::empty({tl.rows, tl.cols}, absmax.options());
  quant::dequantize(tile_view(codes, tl).contiguous(), absmax.narrow(0, s.arow[j], tl.rows),
                    quant::BlockLayout(quant::BlockShape::blocks(tl.cols), tl.rows, tl.cols),
                    second ? code_v_ : code_m_, x);
  tile_view(out, tl).copy_(x);
}

void SOAP::encode_tile(size_t i, size_t j, bool second, const at::Tensor& flat,
                       const at::Tensor& codes) {
  ParamState& s = state_[i];
  const Tile& tl = tiles_[s.tiles[j]];
  at::Tensor q = at::empty({tl.rows, tl.cols}, codes.options().dtype(at::kByte));
  // (the moments' values are checked with the step's)
  quant::quantize(tile_view(flat, tl).contiguous(),
                  quant::BlockLayout(quant::BlockShape::blocks(tl.cols), tl.rows, tl.cols),
                  second ? code_v_ : code_m_, q, (second ? s.va : s.ma).narrow(0, s.arow[j], tl.rows),
                  /*check_finite=*/false);
  tile_view(codes, tl).copy_(q);
}

bool SOAP::has_cut_rows(size_t i) const {
  for (const CutTileRow& row : cut_) {
    if (row.param == i) return true;
  }
  return false;
}

// The shard's whole tiles; the rows of cut tiles stay 0 (their owner decodes them).
at::Tensor SOAP::decode(size_t i, bool second) const {
  const ParamState& s = state_[i];
  const at::Tensor codes = (second ? s.vq : s.mq).view({-1});
  const auto opts = (second ? s.va : s.ma).options();
  // (without cut rows the tiles cover the shard: nothing to clear)
  at::Tensor out = has_cut_rows(i) ? at::zeros({codes.numel()}, opts) : at::empty({codes.numel()}, opts);
  for (size_t j = 0; j < s.tiles.size(); ++j) {
    if (tiles_[s.tiles[j]].cut < 0) decode_tile(i, j, second, codes, out);
  }
  return out;
}

void SOAP::encode(size_t i, bool second, const at::Tensor& flat) {
  ParamState& s = state_[i];
  const at::Tensor codes = (second ? s.vq : s.mq).view({-1});
  for (size_t j = 0; j < s.tiles.size(); ++j) {
    if (tiles_[s.tiles[j]].cut < 0) encode_tile(i, j, second, flat, codes);
  }
}

std::pair<at::Tensor, at::Tensor> SOAP::moments(size_t i) const {
  if (eight_bit(i)) {
    if (has_cut_rows(i)) {
      throw std::logic_error("SOAP::moments: parameter '" + params_.at(i).name +
                             "' has rows of cut tiles, whose 8-bit scales are at their owner; "
                             "read state() (codes by row, scales in tile order)");
    }
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
      const Tile& tl = tiles_[k];
      // (a copy: aligned alike on any ranks, so BLAS rounds alike; Shampoo's)
      const at::Tensor gt = tile_view(tl.cut >= 0 ? cut_g_[tl.cut] : g, tl).clone();
      TileUpdate& u = (*up)[k];
      u.l = unpack_symmetric(s.left, tl.left_offset, tl.rows).mul_(bs).add_(at::mm(gt, gt.t()), 1 - bs);
      u.r = unpack_symmetric(s.right, tl.right_offset, tl.cols).mul_(bs).add_(at::mm(gt.t(), gt), 1 - bs);
      if (refreshes) u.used_l = basis(i, j, true), u.used_r = basis(i, j, false);
      for (bool left : {true, false}) {
        const int64_t d = left ? tl.rows : tl.cols;
        if (t == 1) first[d].push_back({k, left, left ? u.l : u.r, {}});
        if (refreshes) refresh[d].push_back({k, left, left ? u.l : u.r, left ? u.used_l : u.used_r});
      }
    }
  }
  auto where = [&](size_t tile) {
    const Tile& tl = tiles_[tile];
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
    const BasisRefresh r = refresh_bases(at::stack(xs), at::stack(qs));  // [b, d, d]
    for (size_t j = 0; j < js.size(); ++j) {
      if (!r.finite[j]) {
        throw std::runtime_error("SOAP: the basis refresh of " + where(js[j].tile) +
                                 " is not finite (check the gradients)");
      }
      TileUpdate& u = (*up)[js[j].tile];
      (js[j].left ? u.q_l : u.q_r) = r.q[j];
      (js[j].left ? u.order_l : u.order_r) = r.order[j];
    }
  }
}

void SOAP::run_step(StepGate& gate, const std::vector<size_t>& stepping) {
  at::NoGradGuard no_grad;
  cut_g_ = gather_cut_grads(exchange_, cut_, params_, stepping, comm_.get(), gate);
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
  // Tile j of parameter i: v updated in its eigenbasis, n = Q_L ((Q_L^T m Q_R) /
  // (sqrt(v) + eps)) Q_R^T; and (a refresh) v permuted to its basis' new order,
  // once the step has used it. g, m, v, n: flat, laid out as the tile's shard or cut row.
  auto tile_step = [&](size_t i, size_t j, const at::Tensor& g, const at::Tensor& m,
                       const at::Tensor& v, const at::Tensor& n) {
    const SOAPOptions& o = options_of(i);
    const size_t k = state_[i].tiles[j];
    const Tile& tl = tiles_[k];
    const at::Tensor ql = up[k].used_l.defined() ? up[k].used_l : basis(i, j, true);
    const at::Tensor qr = up[k].used_r.defined() ? up[k].used_r : basis(i, j, false);
    const at::Tensor gp = at::mm(at::mm(ql.t(), tile_view(g, tl)), qr);
    at::Tensor vt = tile_view(v, tl);
    vt.mul_(o.beta2).addcmul_(gp, gp, 1 - o.beta2);
    const at::Tensor mp = at::mm(at::mm(ql.t(), tile_view(m, tl)), qr);
    tile_view(n, tl).copy_(at::mm(at::mm(ql, mp / (vt.sqrt() + o.eps)), qr.t()));
  };
  auto permute_v = [&](size_t k, const at::Tensor& v) {
    const TileUpdate& u = up[k];
    if (!u.order_l.defined()) return;  // a refresh: v follows its basis' new column order
    at::Tensor vt = tile_view(v, tiles_[k]);
    vt.copy_(vt.index_select(0, u.order_l).index_select(1, u.order_r));
  };
  // Per parameter: (begin) the moments and the direction n (t >= 2), tile by
  // tile where the tile is whole here (8-bit: decoded first); (finish) the
  // parameter, the factors, the bases, v's refresh permutation (8-bit: encoded).
  // A parameter without cut rows finishes at once (its temporaries freed before
  // the next); one with cut rows after the cut rows' exchange.
  const size_t P = params_.size();
  std::vector<at::Tensor> ms(P), vs(P), ns(P);
  auto begin = [&](size_t i) {
    const SOAPOptions& o = options_of(i);
    ParamState& s = state_[i];
    if (param_steps_[i] < 2) return;
    const at::Tensor g = params_[i].grad.view({-1});
    ms[i] = eight_bit(i) ? decode(i, false) : s.m.view({-1});
    vs[i] = eight_bit(i) ? decode(i, true) : s.v.view({-1});
    ms[i].mul_(o.beta1).add_(g, 1 - o.beta1);
    if (precondition_[i]) {
      ns[i] = at::empty_like(g);
      for (size_t j = 0; j < s.tiles.size(); ++j) {
        if (tiles_[s.tiles[j]].cut < 0) tile_step(i, j, g, ms[i], vs[i], ns[i]);
      }
    } else {
      vs[i].mul_(o.beta2).addcmul_(g, g, 1 - o.beta2);
      ns[i] = ms[i] / (vs[i].sqrt() + o.eps);
    }
  };
  auto finish = [&](size_t i) {
    const SOAPOptions& o = options_of(i);
    ParamState& s = state_[i];
    const int64_t t = param_steps_[i];
    if (t >= 2) {
      const int64_t steps = t - 1;
      const double step =
          config_.correct_bias
              ? o.lr * std::sqrt(1 - std::pow(o.beta2, static_cast<double>(steps))) /
                    (1 - std::pow(o.beta1, static_cast<double>(steps)))
              : o.lr;
      params_[i].param.view({-1}).add_(ns[i], -step).mul_(1 - o.lr * o.weight_decay);
    }
    if (precondition_[i]) {
      for (size_t j = 0; j < s.tiles.size(); ++j) {
        const size_t k = s.tiles[j];
        const Tile& tl = tiles_[k];
        const TileUpdate& u = up[k];
        s.left.narrow(0, tl.left_offset, packed_size(tl.rows)).copy_(pack_symmetric(u.l));
        s.right.narrow(0, tl.right_offset, packed_size(tl.cols)).copy_(pack_symmetric(u.r));
        if (u.q_l.defined()) store_basis(i, j, true, u.q_l);
        if (u.q_r.defined()) store_basis(i, j, false, u.q_r);
        if (tl.cut < 0 && vs[i].defined()) permute_v(k, vs[i]);
      }
      if (eight_bit(i) && t >= 2) {  // (v permuted in fp32 first: the same codes as permuting codes and scales)
        encode(i, false, ms[i]);
        encode(i, true, vs[i]);
      }
    }
    ms[i] = vs[i] = ns[i] = at::Tensor();
  };
  std::vector<bool> has_cut(P, false);
  for (const CutTileRow& row : cut_) has_cut[row.param] = true;
  for (size_t i : stepping) {
    begin(i);
    if (!has_cut[i]) finish(i);
  }
  if (cut_.empty()) return;
  if (state_dtype_8bit_) {
    step_cut_rows_8bit(stepping, has_cut, tile_step, permute_v, ns);
  } else {
    // Cut rows: their m and v to the owner, which steps its tiles of them and
    // sends every holder its rows of v and n back.
    const std::vector<at::Tensor> mv = exchange_.gather(comm_.get(), {ms, vs});
    std::vector<at::Tensor> vn(cut_.size());
    for (size_t j = 0; j < cut_.size(); ++j) {
      if (exchange_.owns(j)) vn[j] = at::stack({mv[j][1], at::zeros_like(mv[j][1])});
    }
    for (size_t i : stepping) {
      if (!precondition_[i] || param_steps_[i] < 2) continue;
      const ParamState& s = state_[i];
      for (size_t j = 0; j < s.tiles.size(); ++j) {
        const size_t k = s.tiles[j];
        const int64_t c = tiles_[k].cut;
        if (c < 0) continue;
        tile_step(i, j, cut_g_[c], mv[c][0], vn[c][0], vn[c][1]);
        permute_v(k, vn[c][0]);
      }
    }
    exchange_.scatter(comm_.get(), vn, {vs, ns});
  }
  for (size_t i : stepping) {
    if (has_cut[i]) finish(i);
  }
}

// 8-bit moments on cut rows: a block is a tile row and its scale is the owner's
// (the scales' tile order: a checkpoint's sequence whatever the ranks), so the
// holders send the owner their codes of the rows, which decodes them, takes m's
// step there with the row's gradient (the holders' own operations, the same
// bits), steps its tiles, encodes m and v with its scales and sends every holder
// its rows of the codes and of n back. An element's two codes travel as one
// float (m + 256 v, exact): 3 floats an element where fp32 moments move 4.
namespace {
at::Tensor pack_codes(const at::Tensor& m, const at::Tensor& v) {
  return m.to(at::kFloat).add_(v.to(at::kFloat), 256);
}
at::Tensor code_of(const at::Tensor& packed, bool second) {
  const at::Tensor i = packed.to(at::kInt);
  return (second ? i.bitwise_right_shift(8) : i.bitwise_and(255)).to(at::kByte);
}
}  // namespace

void SOAP::step_cut_rows_8bit(const std::vector<size_t>& stepping, const std::vector<bool>& has_cut,
                              const TileStepFn& tile_step,
                              const std::function<void(size_t, const at::Tensor&)>& permute_v,
                              const std::vector<at::Tensor>& ns) {
  const size_t P = params_.size();
  // This rank's pieces of the cut rows of parameters that step (element ranges of
  // its flat shard): their codes packed travel, the new ones land there.
  std::vector<at::Tensor> codes(P);
  for (size_t i : stepping) {  // (only the pieces travel: the rest stays unset)
    const at::Tensor& mq = state_[i].mq;
    if (has_cut[i] && param_steps_[i] >= 2) codes[i] = at::empty({mq.numel()}, mq.options().dtype(at::kFloat));
  }
  std::vector<std::pair<size_t, OwnerExchange::Range>> pieces;  // (parameter, {offset, length})
  for (size_t c = 0; c < cut_.size(); ++c) {
    const size_t i = cut_[c].param;
    const OwnerExchange::Range r = exchange_.piece(c, exchange_.rank());
    if (!codes[i].defined() || r.first == r.second) continue;
    const int64_t e0 = params_[i].row_begin * params_[i].row_len;
    pieces.push_back({i, {r.first - e0, r.second - r.first}});
  }
  auto piece_of = [](const at::Tensor& t, const OwnerExchange::Range& r) {
    return t.view({-1}).narrow(0, r.first, r.second);
  };
  for (const auto& [i, r] : pieces) {
    piece_of(codes[i], r).copy_(pack_codes(piece_of(state_[i].mq, r), piece_of(state_[i].vq, r)));
  }
  const std::vector<at::Tensor> rows_in = exchange_.gather(comm_.get(), {codes});
  std::vector<at::Tensor> back(cut_.size());  // [2, numel]: the codes (packed), n
  for (size_t c = 0; c < cut_.size(); ++c) {
    if (exchange_.owns(c)) back[c] = at::stack({rows_in[c][0], at::zeros_like(rows_in[c][0])});
  }
  struct Row {  // an owned cut row of a parameter that steps: its codes and moments
    at::Tensor qm, qv, m, v;
  };
  for (size_t i : stepping) {
    if (!codes[i].defined()) continue;  // (no cut rows, or no moments yet)
    const SOAPOptions& o = options_of(i);
    const ParamState& s = state_[i];
    std::map<int64_t, Row> rows;
    for (size_t j = 0; j < s.tiles.size(); ++j) {
      const int64_t c = tiles_[s.tiles[j]].cut;
      if (c < 0) continue;
      Row& r = rows[c];
      if (!r.m.defined()) {
        r.qm = code_of(back[c][0], false);
        r.qv = code_of(back[c][0], true);
        r.m = at::zeros_like(back[c][1]);  // (its tiles cover the row)
        r.v = at::zeros_like(back[c][1]);
      }
      decode_tile(i, j, false, r.qm, r.m);
      decode_tile(i, j, true, r.qv, r.v);
    }
    for (auto& [c, r] : rows) r.m.mul_(o.beta1).add_(cut_g_[c], 1 - o.beta1);
    for (size_t j = 0; j < s.tiles.size(); ++j) {
      const size_t k = s.tiles[j];
      const int64_t c = tiles_[k].cut;
      if (c < 0) continue;
      Row& r = rows[c];
      tile_step(i, j, cut_g_[c], r.m, r.v, back[c][1]);
      permute_v(k, r.v);  // (before it is encoded: the same codes as permuting codes and scales)
      encode_tile(i, j, false, r.m, r.qm);
      encode_tile(i, j, true, r.v, r.qv);
    }
    for (auto& [c, r] : rows) back[c][0].copy_(pack_codes(r.qm, r.qv));
  }
  exchange_.scatter(comm_.get(), back, {codes, ns});
  for (const auto& [i, r] : pieces) {
    piece_of(state_[i].mq, r).copy_(code_of(piece_of(codes[i], r), false));
    piece_of(state_[i].vq, r).copy_(code_of(piece_of(codes[i], r), true));
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
    if (config_.basis.bits) {
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

NamedState SOAP::requantized_state(size_t i, const SOAPConfig& saved_config,
                                   const NamedState& full) const {
  if (!precondition_.at(i)) return saved_as_kept(i, full, {"exp_avg", "exp_avg_sq"});  // Adam alone
  const ParamShard& p = params_.at(i);
  const TileRange r = tile_range(p, config_.max_preconditioner_dim);
  NamedState out = saved_as_kept(i, full, {"factor_left", "factor_right"});  // as saved
  const bool saved_8bit = full.count("exp_avg_codes") > 0, live_8bit = eight_bit(i);
  const int64_t e0 = p.row_begin * p.row_len;
  for (const bool second : {false, true}) {
    const std::string m = second ? "exp_avg_sq" : "exp_avg";
    const at::Tensor code = quant::dynamic_map(/*is_signed=*/!second);
    if (saved_8bit == live_8bit) {  // kept alike: as saved
      out.merge(saved_as_kept(i, full, live_8bit ? std::vector<std::string>{m + "_codes", m + "_absmax"}
                                                 : std::vector<std::string>{m}));
    } else if (saved_8bit) {  // decoded whole (one scale per tile row), this rank's rows
      const at::Tensor codes = saved(full, m + "_codes", name(), p).reshape(-1).contiguous();
      const at::Tensor absmax = saved(full, m + "_absmax", name(), p).reshape(-1);
      at::Tensor whole = at::zeros({p.full_numel()}, at::kFloat);
      int64_t row = 0;
      for (const Tile& t : r.all) {
        tile_view(whole, t).copy_(code.index({tile_view(codes, t).to(at::kLong)}) *
                                  absmax.narrow(0, row, t.rows).unsqueeze(1));
        row += t.rows;
      }
      out[m] = rows_here(p, whole).view(p.param.sizes());
    } else {  // encoded one block per tile row: the codes of this rank's rows, the
              // scales of its tiles (an owned cut row's whole)
      const at::Tensor whole = saved(full, m, name(), p).reshape(-1).to(at::kFloat).contiguous();
      const int64_t e1 = p.row_end * p.row_len;
      at::Tensor codes = at::zeros({p.full_numel()}, at::kByte);
      std::vector<at::Tensor> scales;
      for (size_t k = 0; k < r.all.size(); ++k) {
        const Tile& t = r.all[k];
        const int64_t t1 = t.local_offset + (t.rows - 1) * t.stride + t.cols;
        const bool mine = k >= r.first && k < r.end;
        if (!mine && (t1 <= e0 || t.local_offset >= e1)) continue;  // no row of it here
        const quant::Quantized q = quant::quantize_blockwise(
            tile_view(whole, t).contiguous(), code, quant::BlockShape::blocks(t.cols), -1,
            /*keep_nonzero=*/second);
        tile_view(codes, t).copy_(q.codes.view({t.rows, t.cols}));
        if (mine) scales.push_back(q.absmax.reshape(-1));
      }
      out[m + "_codes"] = codes.narrow(0, e0, e1 - e0).clone().view(p.param.sizes());
      out[m + "_absmax"] = scales.empty() ? at::zeros({0}, at::kFloat) : at::cat(scales);
    }
  }
  for (bool left : {true, false}) {
    const std::string side = left ? "basis_left" : "basis_right";
    encode_squares(decode_squares(full, side, r, left, saved_config.basis, name(), p), side,
                   config_.basis, config_.basis_dtype, &out);
  }
  return out;
}

std::vector<StateLayout> SOAP::state_layout(size_t i) const {
  const bool eight = eight_bit(i);
  std::vector<StateLayout> out;
  TileRange r;
  if (precondition_.at(i)) r = tile_range(params_.at(i), config_.max_preconditioner_dim);
  for (const char* moment : {"exp_avg", "exp_avg_sq"}) {
    const std::string name(moment);
    if (!eight) {
      out.push_back(StateLayout::rows(name));
      continue;
    }
    out.push_back(StateLayout::rows(name + "_codes"));  // one scale per tile row
    out.push_back(tile_sequence(name + "_absmax", r, [](const Tile& t) { return t.rows; }));
  }
  if (!precondition_.at(i)) return out;
  for (bool left : {true, false}) {
    const auto n = [left](const Tile& t) { return left ? t.rows : t.cols; };
    const std::string side = left ? "left" : "right";
    out.push_back(tile_sequence("factor_" + side, r, [&](const Tile& t) { return packed_size(n(t)); }));
    square_tiles_layout("basis_" + side, r, left, config_.basis, &out);
  }
  return out;
}

}  // namespace rfsdp
