#include "optimizers/soap/soap.h"

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
  check_tiled_config("SOAP", c);
  if (!c.basis.coded() && c.basis_dtype != at::kFloat && c.basis_dtype != at::kBFloat16) {
    throw std::invalid_argument("SOAP: basis_dtype must be torch.float32, torch.bfloat16, \"int8\" "
                                "or \"int4\"");
  }
  if (c.state_dtype != at::kFloat && c.state_dtype != at::kByte) {
    throw std::invalid_argument("SOAP: state_dtype must be torch.float32 or \"int8\" (8-bit codes)");
  }
  if (c.state_format != quant::StateFormat::kDynamic && c.state_dtype != at::kByte) {
    throw std::invalid_argument(std::string("SOAP: state_format=\"") +
                                quant::state_format_name(c.state_format) +
                                "\" codes 8-bit moments; set state_dtype=\"int8\" with it");
  }
}

SOAP::SOAP(std::vector<ParamShard> params, SOAPOptions options, SOAPConfig config,
           std::shared_ptr<Comm> comm, std::vector<bool> precondition)
    : GroupedOptimizer("SOAP", std::move(params), std::move(comm), config.check_finite, options),
      config_(config) {
  check_config(config_);
  state_dtype_8bit_ = config_.state_dtype == at::kByte;
  if (state_dtype_8bit_) {
    code_m_ = quant::Codec::of(config_.state_format, /*is_signed=*/true);
    code_v_ = quant::Codec::of(config_.state_format, /*is_signed=*/false);  // v: keep_nonzero
  }
  check_options(options);
  state_.resize(params_.size());
  set_up_tiles(precondition);
}

void SOAP::clear_moments_and_preconditioner(size_t i) {
  const ParamShard& p = params_[i];
  ParamState& s = state_[i];
  if (!eight_bit(i)) {
    s.m = at::zeros(p.param.sizes(), state_options(i));
    s.v = at::zeros(p.param.sizes(), state_options(i));
  }
  if (!precondition_[i]) return;
  int64_t ql = 0, qr = 0, rows_total = 0;
  std::vector<int64_t> rows, cols;
  s.ql.clear();
  s.qr.clear();
  s.arow.clear();
  for (size_t k : tiles_of(i)) {
    const Tile& t = tiles_[k];
    rows.push_back(t.rows);
    cols.push_back(t.cols);
    s.ql.push_back(ql);
    s.qr.push_back(qr);
    s.arow.push_back(rows_total);
    ql += t.rows * t.rows;
    qr += t.cols * t.cols;
    rows_total += t.rows;
  }
  const auto on = at::TensorOptions().device(p.param.device());  // states live with the shard
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
  const Tile& tl = tiles_[tiles_of(i)[j]];
  const int64_t n = left ? tl.rows : tl.cols;
  return basis_view(left ? s.q_left : s.q_right, left ? s.ql[j] : s.qr[j], n).to(at::kFloat);
}

void SOAP::store_basis(size_t i, size_t j, bool left, const at::Tensor& q) {
  ParamState& s = state_[i];
  if (config_.basis.bits) {
    (left ? s.lq_left : s.lq_right).store(j, q);
    return;
  }
  const Tile& tl = tiles_[tiles_of(i)[j]];
  const int64_t n = left ? tl.rows : tl.cols;
  basis_view(left ? s.q_left : s.q_right, left ? s.ql[j] : s.qr[j], n).copy_(q);
}

// The 8-bit moments: one block per row of each tile (its absmax at arow + row).
// codes: flat, laid out as the tile's shard (or, a cut row's tile, as the row's buffer).
void SOAP::decode_tile(size_t i, size_t j, bool second, const at::Tensor& codes,
                       const at::Tensor& out) const {
  const ParamState& s = state_[i];
  const Tile& tl = tiles_[tiles_of(i)[j]];
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
  const Tile& tl = tiles_[tiles_of(i)[j]];
  at::Tensor q = at::empty({tl.rows, tl.cols}, codes.options().dtype(at::kByte));
  // (the moments' values are checked with the step's)
  quant::quantize(tile_view(flat, tl).contiguous(),
                  quant::BlockLayout(quant::BlockShape::blocks(tl.cols), tl.rows, tl.cols),
                  second ? code_v_ : code_m_, q, (second ? s.va : s.ma).narrow(0, s.arow[j], tl.rows),
                  /*check_finite=*/false);
  tile_view(codes, tl).copy_(q);
}

// The shard's whole tiles; the rows of cut tiles stay 0 (their owner decodes them).
at::Tensor SOAP::decode(size_t i, bool second) const {
  const ParamState& s = state_[i];
  const at::Tensor codes = (second ? s.vq : s.mq).view({-1});
  const auto opts = (second ? s.va : s.ma).options();
  // (without cut rows the tiles cover the shard: nothing to clear)
  at::Tensor out = has_cut_rows(i) ? at::zeros({codes.numel()}, opts) : at::empty({codes.numel()}, opts);
  const std::vector<size_t>& tiles = tiles_of(i);
  for (size_t j = 0; j < tiles.size(); ++j) {
    if (tiles_[tiles[j]].cut < 0) decode_tile(i, j, second, codes, out);
  }
  return out;
}

void SOAP::encode(size_t i, bool second, const at::Tensor& flat) {
  const ParamState& s = state_[i];
  const at::Tensor codes = (second ? s.vq : s.mq).view({-1});
  const std::vector<size_t>& tiles = tiles_of(i);
  for (size_t j = 0; j < tiles.size(); ++j) {
    if (tiles_[tiles[j]].cut < 0) encode_tile(i, j, second, flat, codes);
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

bool SOAP::amortises(size_t i) const {
  const int64_t t = param_steps_[i];
  return precondition_[i] && (t == 1 || (t - 1) % config_.precondition_frequency == 0);
}

bool SOAP::tiles_step(size_t i) const { return precondition_[i] && param_steps_[i] >= 2; }

void SOAP::prepare(const std::vector<size_t>& stepping) {
  up_.assign(tiles_.size(), {});
  const size_t P = params_.size();
  ms_.assign(P, at::Tensor());
  vs_.assign(P, at::Tensor());
  ns_.assign(P, at::Tensor());
  std::vector<TileUpdate>* up = &up_;
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
    const double bs = shampoo_beta(options_of(i));
    const int64_t t = param_steps_[i];
    const bool refreshes = t >= 2 && (t - 1) % config_.precondition_frequency == 0;
    const std::vector<size_t>& tiles = tiles_of(i);
    for (size_t j = 0; j < tiles.size(); ++j) {
      const size_t k = tiles[j];
      const Tile& tl = tiles_[k];
      // (a copy: aligned alike on any ranks, so BLAS rounds alike; Shampoo's)
      const at::Tensor gt = grad_tile(i, tl).clone();
      TileUpdate& u = (*up)[k];
      u.l = unpack_symmetric(factors(i, true), tl.left_offset, tl.rows)
                .mul_(bs).add_(at::mm(gt, gt.t()), 1 - bs);
      u.r = unpack_symmetric(factors(i, false), tl.right_offset, tl.cols)
                .mul_(bs).add_(at::mm(gt.t(), gt), 1 - bs);
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

void SOAP::tile_step(size_t i, size_t j, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
                     const at::Tensor& n) const {
  const SOAPOptions& o = options_of(i);
  const size_t k = tiles_of(i)[j];
  const Tile& tl = tiles_[k];
  const TileUpdate& u = up_[k];
  const at::Tensor ql = u.used_l.defined() ? u.used_l : basis(i, j, true);
  const at::Tensor qr = u.used_r.defined() ? u.used_r : basis(i, j, false);
  const at::Tensor gp = at::mm(at::mm(ql.t(), tile_view(g, tl)), qr);
  at::Tensor vt = tile_view(v, tl);
  vt.mul_(o.beta2).addcmul_(gp, gp, 1 - o.beta2);
  const at::Tensor mp = at::mm(at::mm(ql.t(), tile_view(m, tl)), qr);
  tile_view(n, tl).copy_(at::mm(at::mm(ql, mp / (vt.sqrt() + o.eps)), qr.t()));
}

void SOAP::permute_v(size_t k, const at::Tensor& v) const {
  const TileUpdate& u = up_[k];
  if (!u.order_l.defined()) return;  // a refresh: v follows its basis' new column order
  at::Tensor vt = tile_view(v, tiles_[k]);
  vt.copy_(vt.index_select(0, u.order_l).index_select(1, u.order_r));
}

void SOAP::begin(size_t i) {
  const SOAPOptions& o = options_of(i);
  if (param_steps_[i] < 2) return;
  const at::Tensor g = params_[i].grad.view({-1});
  ms_[i] = eight_bit(i) ? decode(i, false) : state_[i].m.view({-1});
  vs_[i] = eight_bit(i) ? decode(i, true) : state_[i].v.view({-1});
  ms_[i].mul_(o.beta1).add_(g, 1 - o.beta1);
  if (precondition_[i]) {
    ns_[i] = at::empty_like(g);
    const std::vector<size_t>& tiles = tiles_of(i);
    for (size_t j = 0; j < tiles.size(); ++j) {
      if (tiles_[tiles[j]].cut < 0) tile_step(i, j, g, ms_[i], vs_[i], ns_[i]);
    }
  } else {
    vs_[i].mul_(o.beta2).addcmul_(g, g, 1 - o.beta2);
    ns_[i] = ms_[i] / (vs_[i].sqrt() + o.eps);
  }
}

void SOAP::finish(size_t i) {
  const SOAPOptions& o = options_of(i);
  const int64_t t = param_steps_[i];
  if (t >= 2) {
    const int64_t steps = t - 1;
    const double step =
        config_.correct_bias
            ? o.lr * std::sqrt(1 - std::pow(o.beta2, static_cast<double>(steps))) /
                  (1 - std::pow(o.beta1, static_cast<double>(steps)))
            : o.lr;
    params_[i].param.view({-1}).add_(ns_[i], -step).mul_(1 - o.lr * o.weight_decay);
  }
  if (precondition_[i]) {
    const std::vector<size_t>& tiles = tiles_of(i);
    for (size_t j = 0; j < tiles.size(); ++j) {
      const size_t k = tiles[j];
      const Tile& tl = tiles_[k];
      TileUpdate& u = up_[k];
      factor(i, k, true).copy_(pack_symmetric(u.l));
      factor(i, k, false).copy_(pack_symmetric(u.r));
      if (u.q_l.defined()) store_basis(i, j, true, u.q_l);
      if (u.q_r.defined()) store_basis(i, j, false, u.q_r);
      if (tl.cut < 0 && vs_[i].defined()) permute_v(k, vs_[i]);
      u = TileUpdate();
    }
    if (eight_bit(i) && t >= 2) {  // (v permuted in fp32 first: the same codes as permuting codes and scales)
      encode(i, false, ms_[i]);
      encode(i, true, vs_[i]);
    }
  }
  ms_[i] = vs_[i] = ns_[i] = at::Tensor();
}

// The cut rows' m and v to their owner, which steps its tiles of them and sends
// every holder its rows of v and n back.
TiledOptimizer::CutRowFields SOAP::cut_row_fields() const { return {{ms_, vs_}, {vs_, ns_}}; }

at::Tensor SOAP::cut_row_result(const at::Tensor& gathered) const {
  return at::stack({gathered[1], at::zeros_like(gathered[1])});  // v, n
}

void SOAP::cut_tile_step(size_t i, size_t j, const at::Tensor& gathered, const at::Tensor& result) {
  const size_t k = tiles_of(i)[j];
  tile_step(i, j, cut_g_[tiles_[k].cut], gathered[0], result[0], result[1]);
  permute_v(k, result[0]);
}

void SOAP::step_cut_rows(const std::vector<size_t>& stepping) {
  if (state_dtype_8bit_) {
    step_cut_rows_8bit(stepping);
  } else {
    TiledOptimizer::step_cut_rows(stepping);
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

void SOAP::step_cut_rows_8bit(const std::vector<size_t>& stepping) {
  const size_t P = params_.size();
  // This rank's pieces of the cut rows of parameters that step (element ranges of
  // its flat shard): their codes packed travel, the new ones land there.
  std::vector<at::Tensor> codes(P);
  for (size_t i : stepping) {  // (only the pieces travel: the rest stays unset)
    const at::Tensor& mq = state_[i].mq;
    if (has_cut_rows(i) && param_steps_[i] >= 2) codes[i] = at::empty({mq.numel()}, mq.options().dtype(at::kFloat));
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
    const std::vector<size_t>& tiles = tiles_of(i);
    std::map<int64_t, Row> rows;
    for (size_t j = 0; j < tiles.size(); ++j) {
      const int64_t c = tiles_[tiles[j]].cut;
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
    for (size_t j = 0; j < tiles.size(); ++j) {
      const size_t k = tiles[j];
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
  exchange_.scatter(comm_.get(), back, {codes, ns_});
  for (const auto& [i, r] : pieces) {
    piece_of(state_[i].mq, r).copy_(code_of(piece_of(codes[i], r), false));
    piece_of(state_[i].vq, r).copy_(code_of(piece_of(codes[i], r), true));
  }
}

std::vector<std::pair<std::string, at::Tensor>> SOAP::moments_state(size_t i) const {
  const ParamState& s = state_.at(i);
  if (eight_bit(i)) {
    return {{"exp_avg_codes", s.mq}, {"exp_avg_absmax", s.ma},
            {"exp_avg_sq_codes", s.vq}, {"exp_avg_sq_absmax", s.va}};
  }
  return {{"exp_avg", s.m}, {"exp_avg_sq", s.v}};
}

std::vector<std::pair<std::string, at::Tensor>> SOAP::preconditioner_state(size_t i) const {
  const ParamState& s = state_.at(i);
  if (config_.basis.bits) {
    return {{"basis_left_codes", s.lq_left.codes()}, {"basis_left_absmax", s.lq_left.absmax()},
            {"basis_right_codes", s.lq_right.codes()}, {"basis_right_absmax", s.lq_right.absmax()}};
  }
  return {{"basis_left", s.q_left}, {"basis_right", s.q_right}};
}

// m and v decoded or encoded where the saved state_dtype or state_format
// differs; the bases as this one keeps them.
NamedState SOAP::requantized_own(size_t i, const TiledConfig& saved_tiled, const NamedState& full,
                                 const TileRange& r) const {
  const auto* saved_config = dynamic_cast<const SOAPConfig*>(&saved_tiled);
  if (saved_config == nullptr) {
    throw std::logic_error("SOAP::requantized_own: the saved settings are not a SOAPConfig");
  }
  const ParamShard& p = params_.at(i);
  NamedState out;
  const bool saved_8bit = full.count("exp_avg_codes") > 0, live_8bit = eight_bit(i);
  const bool same_codes = saved_config->state_format == config_.state_format;
  const int64_t e0 = p.row_begin * p.row_len;
  for (const bool second : {false, true}) {
    const std::string m = second ? "exp_avg_sq" : "exp_avg";
    if (saved_8bit == live_8bit && (!live_8bit || same_codes)) {  // kept alike: as saved
      out.merge(saved_as_kept(i, full, live_8bit ? std::vector<std::string>{m + "_codes", m + "_absmax"}
                                                 : std::vector<std::string>{m}));
      continue;
    }
    at::Tensor whole;  // the whole moment, fp32
    if (saved_8bit) {  // decoded tile by tile (one scale per tile row)
      const quant::Codec code = quant::Codec::of(saved_config->state_format, /*is_signed=*/!second);
      const at::Tensor codes = saved(full, m + "_codes", name(), p).reshape(-1).contiguous();
      const at::Tensor absmax = saved(full, m + "_absmax", name(), p).reshape(-1).to(at::kFloat);
      whole = at::zeros({p.full_numel()}, at::kFloat);
      int64_t row = 0;
      for (const Tile& t : r.all) {
        tile_view(whole, t).copy_(quant::dequantize_blockwise(
            {tile_view(codes, t).contiguous().view(-1), absmax.narrow(0, row, t.rows).contiguous()},
            code, quant::BlockShape::blocks(t.cols), t.cols).view({t.rows, t.cols}));
        row += t.rows;
      }
    } else {
      whole = saved(full, m, name(), p).reshape(-1).to(at::kFloat).contiguous();
    }
    if (!live_8bit) {  // this rank's rows
      out[m] = rows_here(p, whole).view(p.param.sizes());
      continue;
    }
    // encoded one block per tile row: the codes of this rank's rows, the scales of
    // its tiles (an owned cut row's whole)
    const int64_t e1 = p.row_end * p.row_len;
    at::Tensor codes = at::zeros({p.full_numel()}, at::kByte);
    std::vector<at::Tensor> scales;
    for (size_t k = 0; k < r.all.size(); ++k) {
      const Tile& t = r.all[k];
      const int64_t t1 = t.local_offset + (t.rows - 1) * t.stride + t.cols;
      const bool mine = k >= r.first && k < r.end;
      if (!mine && (t1 <= e0 || t.local_offset >= e1)) continue;  // no row of it here
      const quant::Quantized q = quant::quantize_blockwise(tile_view(whole, t).contiguous(),
                                                           second ? code_v_ : code_m_,
                                                           quant::BlockShape::blocks(t.cols), t.cols);
      tile_view(codes, t).copy_(q.codes.view({t.rows, t.cols}));
      if (mine) scales.push_back(q.absmax.reshape(-1));
    }
    out[m + "_codes"] = codes.narrow(0, e0, e1 - e0).clone().view(p.param.sizes());
    out[m + "_absmax"] = scales.empty() ? at::zeros({0}, at::kFloat) : at::cat(scales);
  }
  for (bool left : {true, false}) {
    const std::string side = left ? "basis_left" : "basis_right";
    encode_squares(decode_squares(full, side, r, left, saved_config->basis, name(), p), side,
                   config_.basis, config_.basis_dtype, &out);
  }
  return out;
}

void SOAP::own_layout(size_t i, const TileRange& r, std::vector<StateLayout>* out) const {
  for (const char* moment : {"exp_avg", "exp_avg_sq"}) {
    const std::string name(moment);
    if (!eight_bit(i)) {
      out->push_back(StateLayout::rows(name));
      continue;
    }
    out->push_back(StateLayout::rows(name + "_codes"));  // one scale per tile row
    out->push_back(tile_sequence(name + "_absmax", r, [](const Tile& t) { return t.rows; }));
  }
  if (!precondition_[i]) return;
  for (bool left : {true, false}) {
    square_tiles_layout(left ? "basis_left" : "basis_right", r, left, config_.basis, out);
  }
}

}  // namespace rfsdp
