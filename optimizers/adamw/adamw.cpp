#include "optimizers/adamw/adamw.h"

#include <cmath>
#include <cstdint>
#include <iterator>
#include <map>
#include <set>
#include <tuple>
#include <stdexcept>
#include <string>
#include <utility>

#include "optimizers/common/adamw_step.h"
#include "optimizers/common/hyperball.h"
#include "quant/ops.h"

namespace rfsdp {

namespace {

quant::AdamWHyper hyper(const AdamWOptions& o, int64_t step) {
  return {static_cast<float>(o.lr), static_cast<float>(o.beta1), static_cast<float>(o.beta2),
          static_cast<float>(o.eps), static_cast<float>(o.weight_decay), step};
}

}  // namespace

void AdamW::check_options(const AdamWOptions& o) const {
  const std::string who = name();
  check_option(who, "lr", o.lr, o.lr >= 0, ">= 0");
  check_option(who, "betas[0]", o.beta1, o.beta1 >= 0 && o.beta1 < 1, "in [0, 1)");
  check_option(who, "betas[1]", o.beta2, o.beta2 >= 0 && o.beta2 < 1, "in [0, 1)");
  check_option(who, "eps", o.eps, o.eps > 0, "> 0");
  check_option(who, "weight_decay", o.weight_decay, o.weight_decay >= 0, ">= 0");
  if (o.hyperball && o.weight_decay != 0.0) {
    throw std::invalid_argument(who + ": a group with hyperball=True takes no weight decay (Hyperball "
                                "keeps every matrix's norm at its radius instead): set its "
                                "weight_decay to 0, got " + std::to_string(o.weight_decay));
  }
  check_option(who, "hyperball_radius", o.hyperball_radius, o.hyperball_radius >= 0,
               ">= 0 (0 or None: the parameter's norm when it first steps)");
}

AdamW::AdamW(std::vector<ParamShard> params, AdamWOptions options, std::shared_ptr<Comm> comm)
    : AdamW(std::move(params), options, std::move(comm), std::vector<bool>()) {}

AdamW::AdamW(std::vector<ParamShard> params, AdamWOptions options, std::shared_ptr<Comm> comm,
             const std::vector<bool>& fp32_state)
    : GroupedOptimizer(fp32_state.empty() ? "AdamW" : "AdamW8bit", std::move(params),
                       std::move(comm), options.check_finite, options),
      fused_on_cpu_(options.fused_on_cpu) {
  check_options(options);
  for (size_t i = 0; i < params_.size(); ++i) {
    const bool fp32 = fp32_state.empty() || fp32_state[i];
    m_.push_back(fp32 ? at::zeros(params_[i].param.sizes(), state_options(i)) : at::Tensor());
    v_.push_back(fp32 ? at::zeros(params_[i].param.sizes(), state_options(i)) : at::Tensor());
    radius_.push_back(at::zeros({1}, state_options(i)));
  }
}

namespace {

// A parameter held in column parts (TensorShard::col_parts: RowwiseParallel's
// Shard(1)) is stepped in its shard's rows, the parts' rows one after another.
// Its 8-bit blocks are the global tensor's there only where each lies whole in one
// part's row segment and the shard's blocking restarts with each part: 1-D blocks
// that divide the part's width, tiles whose columns divide it and whose rows
// divide the tensor's rows. Blocks the parts' column boundaries would cut are
// refused (their scales would need agreeing across parts every step).
void check_column_blocks(const ParamShard& p, const quant::BlockShape& b) {
  if (p.col_parts == 1) return;
  const int64_t rows = p.shape[0], cols = p.shape[1], width = p.row_len;
  const bool whole = b.is_tile() ? width % b.tile_cols == 0 && rows % b.tile_rows == 0
                                 : width % b.block == 0;
  if (whole) return;
  throw std::invalid_argument(
      "AdamW8bit: parameter '" + p.name + "' (" + std::to_string(rows) + " x " +
      std::to_string(cols) + ") is held in " + std::to_string(p.col_parts) + " column parts of " +
      std::to_string(width) + " columns (tensor parallelism's Shard(1), as RowwiseParallel leaves "
      "it): its " + b.str() + " of the global tensor would be cut by the parts' column "
      "boundaries; use " + (b.is_tile() ? "tiles whose columns divide " + std::to_string(width) +
                                              " and whose rows divide " + std::to_string(rows)
                                        : "a block size that divides " + std::to_string(width)) +
      " (the column part width), or give it to rfsdp.optim.AdamW (an optimizer of its own)");
}

std::vector<bool> small_tensors(const std::vector<ParamShard>& params, int64_t min_8bit_size) {
  std::vector<bool> small;
  for (const auto& p : params) small.push_back(p.full_rows * p.row_len < min_8bit_size);
  return small;
}
}  // namespace

void AdamW::run_step(StepGate& gate, const std::vector<size_t>& stepping) {
  // Nothing but the gradients' check can fail before state changes: without it
  // (a caller that gates the step itself, as Python's Muon does) no collective.
  if (check_finite_) gate.agree();
  step_with_hyperball(stepping);
}

void AdamW::step_with_hyperball(const std::vector<size_t>& stepping) {
  // (by the groups' options, the same on every rank: whether the all-reduce runs)
  std::vector<size_t> ball_params;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (hyperball_of(i)) ball_params.push_back(i);
  }
  hyperball_bytes_ = 0;
  if (ball_params.empty()) {
    step_params(stepping);
    return;
  }
  Comm* group = comm_ && comm_->size() > 1 ? comm_.get() : nullptr;
  if (group && !rank_rows_known_) {  // (collective, once: which parameters ranks cut)
    gather_rank_rows(group, &params_, name());
    rank_rows_known_ = true;
  }
  std::vector<char> in_ball(params_.size(), 0), steps(params_.size(), 0);
  for (size_t i : ball_params) in_ball[i] = 1;
  std::vector<size_t> ball;
  for (size_t i : stepping) {
    steps[i] = 1;
    if (in_ball[i]) ball.push_back(i);
  }
  // The direction d of a Hyperball parameter into a scratch buffer in place of the
  // parameter: lr 1, no decay (a Hyperball group has none), so the buffer ends as
  // -d; its group's other parameters (1-D ones) keep the group's lr: the Hyperball
  // ones step under a copy of their group's options with lr 1, added for the call.
  // Every parameter in one step_params call: AdamW8bit agrees its shared blocks in
  // one all-reduce.
  std::vector<at::Tensor> kept(params_.size()), minus_d(params_.size());
  const std::vector<AdamWOptions> groups = groups_;
  const std::vector<size_t> group_of = group_of_;
  std::vector<size_t> lr_one(groups_.size(), SIZE_MAX);  // group -> its lr-1 copy
  for (size_t i : ball) {
    kept[i] = params_[i].param;
    minus_d[i] = at::zeros(kept[i].sizes(), state_options(i));
    params_[i].param = minus_d[i];
    const size_t g = group_of[i];
    if (lr_one[g] == SIZE_MAX) {
      lr_one[g] = groups_.size();
      groups_.push_back(groups[g]);
      groups_.back().lr = 1.0;
    }
    group_of_[i] = lr_one[g];
  }
  auto restore = [&] {
    for (size_t i : ball) params_[i].param = kept[i];
    groups_ = groups;
    group_of_ = group_of;
  };
  try {
    step_params(stepping);
  } catch (...) {
    restore();
    throw;
  }
  restore();
  // Slots per Hyperball parameter: |W|^2, <W, -d>, |d|^2 (float64).
  const size_t n = ball_params.size();
  std::vector<double> sums(3 * n, 0.0);
  std::vector<char> cut(3 * n, 0);
  std::vector<at::Tensor> parts;
  for (size_t q = 0; q < n; ++q) {
    const size_t i = ball_params[q];
    cut[3 * q] = cut[3 * q + 1] = cut[3 * q + 2] =
        group != nullptr && steps[i] && cut_across_ranks(params_[i], false);
    if (!steps[i]) continue;
    const at::Tensor& w = params_[i].param;
    parts.push_back(at::stack({sum_of_products(w, w), sum_of_products(w, minus_d[i]),
                               sum_of_products(minus_d[i], minus_d[i])}));
  }
  if (!parts.empty()) {
    const at::Tensor all = at::cat(parts).cpu();
    const double* a = all.data_ptr<double>();
    size_t j = 0;
    for (size_t q = 0; q < n; ++q) {
      if (!steps[ball_params[q]]) continue;
      for (int c = 0; c < 3; ++c) sums[3 * q + c] = a[3 * j + c];
      ++j;
    }
  }
  // (a parameter a rank does not step here is stepped by none: fully_shard's
  // ranks all have its gradient or none do)
  hyperball_bytes_ = sum_cut_slots(group, &sums, cut);
  for (size_t q = 0; q < n; ++q) {
    const size_t i = ball_params[q];
    if (!steps[i] || params_[i].rows() == 0) continue;
    const AdamWOptions& h = options_of(i);
    double radius = h.hyperball_radius;
    if (radius == 0.0) {
      radius = radius_[i].item<double>();
      if (radius == 0.0) radius = std::sqrt(sums[3 * q]);  // the first step: its norm now
    }
    radius_[i].fill_(radius);
    const HyperballScale b = hyperball_scale(h.lr, radius, sums[3 * q], -sums[3 * q + 1], sums[3 * q + 2]);
    at::Tensor w = params_[i].param;
    at::Tensor x = w.scalar_type() == at::kFloat ? w : w.to(at::kFloat);
    x.add_(minus_d[i], b.a).mul_(b.s);  // s (W - a d)
    if (!x.is_same(w)) w.copy_(x);
  }
}

void AdamW::add_radius(size_t i, std::vector<std::pair<std::string, at::Tensor>>* out) const {
  if (hyperball_of(i)) out->emplace_back("hyperball_radius", radius_.at(i));
}

void AdamW::add_radius_layout(size_t i, std::vector<StateLayout>* out) const {
  if (!hyperball_of(i)) return;
  // One value every holder keeps: the first rank holding rows writes it.
  const ParamShard& p = params_.at(i);
  const bool writer = !comm_ || comm_->size() == 1 || p.rank_rows.empty() ||
                      comm_->rank() == first_holder(p);
  out->push_back(StateLayout::sequence("hyperball_radius", 1, 0, writer ? 0 : 1));
}

void AdamW::update_params(const std::vector<size_t>& stepping) {
  std::vector<AdamWStep> fp32;  // fp32 moments: the shared update (CPU kernel or torch's fused one)
  for (size_t i : stepping) {
    if (!m_[i].defined()) {
      update(i, param_steps_[i]);
      continue;
    }
    const AdamWOptions& o = options_of(i);
    fp32.push_back({params_[i].param, params_[i].grad, m_[i], v_[i], o.lr, o.beta1, o.beta2, o.eps,
                    o.weight_decay, param_steps_[i], group_of_[i]});
  }
  fused_launches_ += adamw_fp32_steps(fp32, fused_on_cpu_);
}

void AdamW::clear_state(size_t i) {
  if (!m_.at(i).defined()) return;
  m_[i].zero_();
  v_[i].zero_();
}

void AdamW::update(size_t i, int64_t) {
  throw std::logic_error("AdamW: parameter '" + params_.at(i).name + "' has no fp32 moments");
}

std::vector<std::pair<std::string, at::Tensor>> AdamW::state(size_t i) const {
  std::vector<std::pair<std::string, at::Tensor>> out{{"exp_avg", m_.at(i)}, {"exp_avg_sq", v_.at(i)}};
  add_radius(i, &out);
  return out;
}

std::vector<StateLayout> AdamW::state_layout(size_t i) const {
  std::vector<StateLayout> out{StateLayout::rows("exp_avg"), StateLayout::rows("exp_avg_sq")};
  add_radius_layout(i, &out);
  return out;
}

AdamW8bit::AdamW8bit(std::vector<ParamShard> params, AdamWOptions options, AdamW8bitConfig config,
                     std::shared_ptr<Comm> comm)
    : AdamW(params, options, std::move(comm), small_tensors(params, config.min_8bit_size)),
      block_(config.block),
      format_(config.state_format) {
  block_.check();
  code1_ = quant::Codec::of(format_, /*is_signed=*/true);
  code2_ = quant::Codec::of(format_, /*is_signed=*/false);  // v keep_nonzero: see CodeLut
  // Every rank's rows over comm's ranks where a shard knows them over fewer (a
  // tensor-parallel model's norm, sharded over dp and alike over tp): the ranks
  // that share a cut block agree its scale over comm (replicas add equal ones).
  gather_rank_rows(comm_.get(), &params_, "AdamW8bit");
  for (size_t i = 0; i < params_.size(); ++i) {
    const ParamShard& p = params_[i];
    const bool eight = p.full_numel() >= config.min_8bit_size;
    if (eight) check_column_blocks(p, block_);
    eight_bit_.push_back(eight);
    q_.push_back({});
    if (eight) {
      const int64_t shared = lay_out(i, agreed_entries_);
      if (shared > 0 && (!comm_ || comm_->size() != static_cast<int>(p.rank_rows.size()))) {
        throw std::invalid_argument(
            "AdamW8bit: parameter '" + p.name + "' has quantisation blocks that its ranks' "
            "shards cut (" + block_.str() + "); the ranks sharing one agree its scale, so the "
            "optimizer needs their process group (" + std::to_string(p.rank_rows.size()) +
            " ranks; it has " + (comm_ ? std::to_string(comm_->size()) : std::string("none")) + ")");
      }
      agreed_entries_ += shared;
      Quantized8& q = q_.back();
      int64_t blocks = 0;
      for (const Region& r : q.regions) blocks += r.layout.num_blocks;
      const auto dev = state_options(i);
      q.q1 = at::full({p.param.numel()}, code1_.zero_code(), dev.dtype(at::kByte));
      q.q2 = at::full({p.param.numel()}, code2_.zero_code(), dev.dtype(at::kByte));
      q.absmax1 = at::zeros({blocks}, dev);
      q.absmax2 = at::zeros({blocks}, dev);
    }
  }
}

void AdamW8bit::clear_state(size_t i) {
  if (!eight_bit_.at(i)) {
    AdamW::clear_state(i);
    return;
  }
  Quantized8& q = q_[i];  // zero codes decode to the maps' values nearest 0
  q.q1.fill_(code1_.zero_code());
  q.q2.fill_(code2_.zero_code());
  q.absmax1.zero_();
  q.absmax2.zero_();
}

int64_t AdamW8bit::lay_out(size_t i, int64_t cut_offset) {
  const ParamShard& p = params_[i];
  Quantized8& q = q_[i];
  // Units: 1-D blocks (measured in elements) or rows of tiles (in rows); a cut unit
  // is one a shard boundary falls inside.
  const bool tiles = block_.is_tile();
  const int64_t unit = tiles ? block_.tile_rows : block_.block;
  const int64_t per_unit = tiles ? (p.row_len + block_.tile_cols - 1) / block_.tile_cols : 1;
  const int64_t extent = tiles ? p.full_rows : p.full_numel();
  const int64_t step = tiles ? p.row_len : 1;  // elements per unit of measure
  auto at_row = [&](int64_t row) { return tiles ? row : row * p.row_len; };
  std::set<int64_t> cut;
  auto boundary = [&](int64_t row) {
    const int64_t x = at_row(row);
    if (x > 0 && x < extent && x % unit != 0) cut.insert(x / unit);
  };
  if (p.rows() > 0) {
    boundary(p.row_begin);
    boundary(p.row_end);
  }
  if (!cut.empty() && !p.knows_every_rank()) {
    try {
      quant::check_whole_blocks(block_, p.name, p.full_rows, p.row_len, p.row_begin, p.rows());
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("AdamW8bit: ") + e.what() +
                                  " (or describe the shard with every rank's rows, so the ranks "
                                  "that share a block can agree its scale)");
    }
  }
  for (const auto& [b, e] : p.rank_rows) {
    if (e > b) {
      boundary(b);
      boundary(e);
    }
  }
  shared_owner_.insert(shared_owner_.end(), cut.size() * per_unit, i);
  q.span.global_blocks = (extent + unit - 1) / unit * per_unit;
  if (p.rows() == 0) return static_cast<int64_t>(cut.size()) * per_unit;  // (tiles: per tile column)
  const int64_t x0 = at_row(p.row_begin), x1 = at_row(p.row_end);
  const int64_t u0 = x0 / unit, u1 = (x1 - 1) / unit + 1;
  q.span.first = u0 * per_unit;
  q.span.shared_head = u0 * unit < x0 ? per_unit : 0;
  auto layout = [&](int64_t len) {  // len units of measure from a unit edge
    return tiles ? quant::BlockLayout(block_, len, p.row_len) : quant::BlockLayout(block_, 1, len);
  };
  int64_t block = 0, whole_from = -1;
  auto close_whole = [&](int64_t x) {
    if (whole_from < 0) return;
    Region r;
    r.elem = (whole_from - x0) * step;
    r.layout = layout(x - whole_from);
    r.block = block - r.layout.num_blocks;
    q.regions.push_back(r);
    whole_from = -1;
  };
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t lo = std::max(x0, u * unit), hi = std::min(x1, (u + 1) * unit);
    if (cut.count(u)) {
      close_whole(lo);
      Region r;
      r.elem = (lo - x0) * step;
      r.block = block;
      r.layout = layout(hi - lo);
      r.agreed = cut_offset + static_cast<int64_t>(std::distance(cut.begin(), cut.find(u))) * per_unit;
      q.regions.push_back(r);
    } else if (whole_from < 0) {
      whole_from = lo;
    }
    block += per_unit;
  }
  close_whole(x1);
  return static_cast<int64_t>(cut.size()) * per_unit;
}

void AdamW8bit::update(size_t i, int64_t step) {
  ParamShard& p = params_[i];
  Quantized8& q = q_[i];
  const quant::AdamWHyper h = hyper(options_of(i), step);
  for (const Region& r : q.regions) {  // the whole blocks (the shared ones stepped already)
    if (r.agreed >= 0) continue;
    const int64_t n = r.layout.numel, nb = r.layout.num_blocks;
    quant::adamw8bit_step(p.param.view(-1).narrow(0, r.elem, n), p.grad.view(-1).narrow(0, r.elem, n),
                          q.q1.narrow(0, r.elem, n), q.absmax1.narrow(0, r.block, nb),
                          q.q2.narrow(0, r.elem, n), q.absmax2.narrow(0, r.block, nb), r.layout,
                          code1_, code2_, h);
  }
}

void AdamW8bit::run_step(StepGate& gate, const std::vector<size_t>& stepping) {
  if (check_finite_) gate.agree();
  step_with_hyperball(stepping);
}

void AdamW8bit::step_params(const std::vector<size_t>& stepping) {
  if (agreed_entries_ > 0) step_shared_blocks(stepping);
  update_params(stepping);
}

void AdamW8bit::step_shared_blocks(const std::vector<size_t>& stepping) {
  // Per shared block: the new absmax of m and of v over this rank's elements,
  // whether this rank steps it, whether it holds some of it without a gradient.
  // One max all-reduce gives every rank the block's absmax (and the flags), on the
  // device the group reduces on; the amax stay on theirs until then.
  const int64_t K = agreed_entries_;
  at::Tensor agreed = at::zeros({4 * K}, at::TensorOptions().device(comm_->control_device()));
  std::vector<float> flags(2 * K, 0.0f);
  std::vector<bool> steps(params_.size(), false);
  for (size_t i : stepping) steps[i] = true;
  struct Pending {
    size_t i;
    const Region* r;
    at::Tensor param;  // the region's parameter, updated on a copy until agreed
    quant::SharedStep half;
  };
  std::vector<Pending> pending;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!eight_bit_[i]) continue;
    ParamShard& p = params_[i];
    Quantized8& q = q_[i];
    for (const Region& r : q.regions) {
      if (r.agreed < 0) continue;
      const int64_t n = r.layout.numel, nb = r.layout.num_blocks;
      if (!steps[i]) {
        for (int64_t j = 0; j < nb; ++j) flags[K + r.agreed + j] = 1.0f;
        continue;
      }
      Pending pd{i, &r, p.param.view(-1).narrow(0, r.elem, n).clone(), {}};
      pd.half = quant::adamw8bit_begin(pd.param, p.grad.view(-1).narrow(0, r.elem, n),
                                       q.q1.narrow(0, r.elem, n), q.absmax1.narrow(0, r.block, nb),
                                       q.q2.narrow(0, r.elem, n), q.absmax2.narrow(0, r.block, nb),
                                       r.layout, code1_, code2_, hyper(options_of(i), param_steps_[i]));
      agreed.narrow(0, r.agreed, nb).copy_(pd.half.moments.amax1);
      agreed.narrow(0, K + r.agreed, nb).copy_(pd.half.moments.amax2);
      for (int64_t j = 0; j < nb; ++j) flags[r.agreed + j] = 1.0f;
      pending.push_back(std::move(pd));
    }
  }
  agreed.narrow(0, 2 * K, 2 * K).copy_(at::tensor(flags));
  comm_->all_reduce(agreed, ReduceOp::Max).wait();
  const at::Tensor agreed_flags = agreed.narrow(0, 2 * K, 2 * K).cpu();
  const float* f = agreed_flags.data_ptr<float>();
  for (int64_t k = 0; k < K; ++k) {
    if (f[k] > 0 && f[K + k] > 0) {
      // The same on every rank, before anything changed (the step does not count).
      for (size_t i : stepping) --param_steps_[i];
      throw std::invalid_argument(
          "AdamW8bit step: parameter '" + params_[shared_owner_[k]].name + "' has a gradient on "
          "some of the ranks that share one of its blocks and none on others; give every rank "
          "a gradient for it (zeros where it has none), or none on any. Nothing was changed");
    }
  }
  for (Pending& pd : pending) {
    ParamShard& p = params_[pd.i];
    Quantized8& q = q_[pd.i];
    const Region& r = *pd.r;
    const int64_t n = r.layout.numel, nb = r.layout.num_blocks;
    const auto on = [&](int64_t entry) { return agreed.narrow(0, entry, nb).to(p.param.device()); };
    quant::adamw8bit_end(pd.half, on(r.agreed), on(K + r.agreed), r.layout, code1_, code2_,
                         q.q1.narrow(0, r.elem, n), q.absmax1.narrow(0, r.block, nb),
                         q.q2.narrow(0, r.elem, n), q.absmax2.narrow(0, r.block, nb));
    p.param.view(-1).narrow(0, r.elem, n).copy_(pd.param);
  }
}

int64_t AdamW8bit::shared_blocks() const {
  int64_t n = 0;
  for (size_t i = 0; i < q_.size(); ++i) {
    if (!eight_bit_[i]) continue;
    for (const Region& r : q_[i].regions) {
      if (r.agreed >= 0) n += r.layout.num_blocks;
    }
  }
  return n;
}

at::Tensor AdamW8bit::dequantized(size_t i, bool second) const {
  const ParamShard& p = params_.at(i);
  const Quantized8& q = q_[i];
  const at::Tensor& codes = second ? q.q2 : q.q1;
  const at::Tensor& absmax = second ? q.absmax2 : q.absmax1;
  at::Tensor out = at::empty({codes.numel()}, absmax.options());
  for (const Region& r : q.regions) {
    const int64_t n = r.layout.numel;
    quant::dequantize(codes.narrow(0, r.elem, n), absmax.narrow(0, r.block, r.layout.num_blocks),
                      r.layout, second ? code2_ : code1_, out.narrow(0, r.elem, n));
  }
  return out.view(p.param.sizes());
}

at::Tensor AdamW8bit::exp_avg(size_t i) const {
  return eight_bit_.at(i) ? dequantized(i, false) : m_[i];
}

at::Tensor AdamW8bit::exp_avg_sq(size_t i) const {
  return eight_bit_.at(i) ? dequantized(i, true) : v_[i];
}

std::vector<std::pair<std::string, at::Tensor>> AdamW8bit::state(size_t i) const {
  if (!eight_bit_.at(i)) return AdamW::state(i);
  std::vector<std::pair<std::string, at::Tensor>> out{
      {"q1", q_[i].q1}, {"absmax1", q_[i].absmax1}, {"q2", q_[i].q2}, {"absmax2", q_[i].absmax2}};
  add_radius(i, &out);
  return out;
}

NamedState AdamW8bit::requantized_state(size_t i, const AdamW8bitConfig& saved_config,
                                        const NamedState& full) const {
  const ParamShard& p = params_.at(i);
  NamedState out;
  if (hyperball_of(i)) out = saved_as_kept(i, full, {"hyperball_radius"});
  const struct { const char *codes, *scales, *moment; bool is_signed; } moments[] = {
      {"q1", "absmax1", "exp_avg", true}, {"q2", "absmax2", "exp_avg_sq", false}};
  for (const auto& m : moments) {
    // The whole tensor (the global order: its blocks are the global tensor's), then
    // in the shard's rows as the optimizer sees them (they decide the blocks).
    at::Tensor whole;
    if (full.count(m.codes)) {
      const int64_t row_len = p.col_parts > 1 ? p.shape[1] : p.row_len;  // the global tensor's
      whole = quant::dequantize_blockwise({saved(full, m.codes, name(), p).reshape(-1),
                                           saved(full, m.scales, name(), p).reshape(-1)},
                                          quant::Codec::of(saved_config.state_format, m.is_signed),
                                          saved_config.block, row_len);
    } else {
      whole = saved(full, m.moment, name(), p).to(at::kFloat);
    }
    whole = in_shard_rows(p, whole).contiguous();
    const auto here = [&](const at::Tensor& t) {
      return t.reshape({p.full_rows, p.row_len}).narrow(0, p.row_begin, p.rows()).reshape(-1).clone();
    };
    if (!eight_bit_.at(i)) {
      out[m.moment] = here(whole).view(p.param.sizes());
      continue;
    }
    const quant::Quantized q = quant::quantize_blockwise(
        whole, m.is_signed ? code1_ : code2_, block_, p.row_len);
    out[m.codes] = here(q.codes);
    out[m.scales] = q.absmax.reshape(-1).narrow(0, q_[i].span.first, q_[i].absmax1.numel()).clone();
  }
  return out;
}

std::vector<StateLayout> AdamW8bit::state_layout(size_t i) const {
  if (!eight_bit_.at(i)) return AdamW::state_layout(i);
  // Codes flat, in the order of the tensor's elements; scales in its blocks' order.
  const ParamShard& p = params_[i];
  const BlockSpan& s = q_[i].span;
  std::vector<StateLayout> out;
  if (p.col_parts > 1) {
    column_parts_layout(i, &out);
  } else {
    for (const char* codes : {"q1", "q2"}) {
      out.push_back(StateLayout::sequence(codes, p.full_numel(), p.row_begin * p.row_len));
    }
    for (const char* scales : {"absmax1", "absmax2"}) {
      out.push_back(StateLayout::sequence(scales, s.global_blocks, s.first, s.shared_head));
    }
  }
  add_radius_layout(i, &out);
  return out;
}

void AdamW8bit::column_parts_layout(size_t i, std::vector<StateLayout>* out) const {
  // The shard's rows are row r of part j at j * rows + r (TensorShard::col_parts);
  // its blocks lie whole in those rows' segments (check_column_blocks), each a
  // block of the global tensor: codes are a run per row, scales a run per row of
  // blocks (1-D blocks: width / block; tiles: a row of tiles, width / tile_cols).
  const ParamShard& p = params_[i];
  const BlockSpan& s = q_[i].span;
  const int64_t rows = p.shape[0], cols = p.shape[1], width = p.row_len;
  std::vector<std::pair<int64_t, int64_t>> codes, scales;
  for (int64_t v = p.row_begin; v < p.row_end; ++v) {
    codes.emplace_back((v % rows) * cols + (v / rows) * width, width);
  }
  const bool tiles = block_.is_tile();
  const int64_t per_row = tiles ? width / block_.tile_cols : width / block_.block;  // per unit
  const int64_t unit_rows = tiles ? block_.tile_rows : 1;  // rows of one unit (a row of blocks)
  const int64_t global_per_row = tiles ? cols / block_.tile_cols : cols / block_.block;
  const int64_t n = q_[i].absmax1.numel();
  for (int64_t u = s.first / per_row; u * per_row < s.first + n; ++u) {
    const int64_t v = u * unit_rows;  // the unit's first row in the shard's rows
    scales.emplace_back((v % rows) / unit_rows * global_per_row + (v / rows) * per_row, per_row);
  }
  for (const char* name : {"q1", "q2"}) {
    out->push_back(StateLayout::sequence_runs(name, p.full_numel(), codes));
  }
  for (const char* name : {"absmax1", "absmax2"}) {
    out->push_back(StateLayout::sequence_runs(name, s.global_blocks, scales, s.shared_head));
  }
}

}  // namespace rfsdp
