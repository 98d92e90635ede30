#include "optimizers/muon/muon.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "optimizers/common/adamw_step.h"
#include "optimizers/common/finite.h"
#include "optimizers/common/hyperball.h"
#include "optimizers/common/step_gate.h"
#include "optimizers/muon/step.h"
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

MuonLayout Muon::layout_of(Comm* comm, std::vector<ParamShard>* params, const MuonConfig& c,
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
    steps.push_back(ns_steps.empty() ? c.ns_steps : ns_steps[i]);
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

// The 8-bit momentum's code: a signed code map ("dynamic", "linear"), or
// float8_e4m3fn codes (quant/formats/fp8_e4m3.h).
quant::Codec momentum_codec(const std::string& map) {
  if (map == "float8_e4m3fn") return quant::Codec::float8_e4m3(/*keep_nonzero=*/false);
  return quant::Codec(quant::code_map(map, /*is_signed=*/true));
}

}  // namespace

void check_config(const MuonConfig& c) {
  if (c.ns_dtype != at::kFloat && c.ns_dtype != at::kBFloat16) {
    throw std::invalid_argument("Muon: ns_dtype must be torch.float32 or torch.bfloat16");
  }
  const at::ScalarType md = c.momentum_dtype;
  if (md != at::kFloat && md != at::kBFloat16 && md != at::kByte) {
    throw std::invalid_argument("Muon: momentum_dtype must be torch.float32, torch.bfloat16 or "
                                "\"int8\" (8-bit block-wise codes)");
  }
  if (c.momentum_map != "dynamic" && c.momentum_map != "linear" &&
      c.momentum_map != "float8_e4m3fn") {
    throw std::invalid_argument("Muon: momentum_map must be \"dynamic\", \"linear\" or "
                                "\"float8_e4m3fn\", got \"" + c.momentum_map + "\"");
  }
  if (c.momentum_block < 1) {
    throw std::invalid_argument("Muon: momentum_block must be a positive integer, got " +
                                std::to_string(c.momentum_block));
  }
  if (c.ns_steps < 1) {
    throw std::invalid_argument("Muon: ns_steps must be a positive integer, got " +
                                std::to_string(c.ns_steps));
  }
}

Muon::Muon(std::vector<ParamShard> params, MuonOptions options, MuonConfig config,
           std::shared_ptr<Comm> comm, std::vector<int> ns_steps, std::vector<bool> use_muon,
           std::vector<std::vector<int64_t>> split_sizes, std::vector<int> split_dims)
    : GroupedOptimizer("Muon", std::move(params), std::move(comm), config.check_finite, options),
      config_(std::move(config)),
      muon_(muon_indices(params_.size(), use_muon)),
      layout_(layout_of(comm_.get(), &params_, config_, std::move(ns_steps), use_muon, split_sizes,
                        split_dims)) {
  check_options(options);
  check_config(config_);
  for (size_t k = 0; k < layout_.shards().size(); ++k) {
    config_.ns_coefficients.check_steps("Muon: parameter '" + layout_.shards()[k].name + "'",
                                         layout_.ns_steps(k));
  }
  if (eight_bit()) code_ = momentum_codec(config_.momentum_map);
  const size_t P = params_.size();
  in_muon_.assign(P, -1);
  for (size_t k = 0; k < muon_.size(); ++k) in_muon_[muon_[k]] = static_cast<int64_t>(k);
  momenta_.resize(P);
  absmax_.resize(P);
  normuon_v_.resize(P);
  radius_.resize(P);
  exp_avg_.resize(P);
  exp_avg_sq_.resize(P);
  for (size_t i = 0; i < P; ++i) {
    const ParamShard& p = params_[i];
    if (!uses_muon(i)) {  // AdamW's moments
      exp_avg_[i] = at::zeros(p.param.sizes(), state_options(i));
      exp_avg_sq_[i] = at::zeros(p.param.sizes(), state_options(i));
      continue;
    }
    // (every Muon parameter: whether it is Hyperball's is its group's option, which a
    // scheduler may change)
    radius_[i] = at::zeros({1}, state_options(i));
    if (config_.normuon) {
      normuon_v_[i] = at::zeros({p.rows() * p.row_len / matrix_cols(i) * v_per_row(i)}, state_options(i));
    }
    if (!eight_bit()) {
      momenta_[i] = at::zeros(p.param.sizes(), p.param.options().dtype(config_.momentum_dtype));
      continue;
    }
    require_own_rows("Muon", p, "int8 momentum blocks");
    quant::check_whole_blocks(quant::BlockShape::blocks(config_.momentum_block), p.name,
                              p.full_rows, p.row_len, p.row_begin, p.rows());
    // zero codes decode to the map's value nearest 0: store its code
    momenta_[i] = at::full(p.param.sizes(), code_.zero_code(), p.param.options().dtype(at::kByte));
    absmax_[i] = at::zeros({block_layout(i).num_blocks}, p.param.options().dtype(at::kFloat));
  }
}

int64_t Muon::matrix_cols(size_t i) const {
  for (const MuonMatrix& m : layout_.matrices()) {
    if (muon_[m.param] == i) return m.cols;
  }
  throw std::logic_error("Muon: parameter '" + params_.at(i).name + "' has no matrix");
}

int64_t Muon::v_per_row(size_t i) const {
  for (const MuonMatrix& m : layout_.matrices()) {
    if (muon_[m.param] == i) return std::max<int64_t>(1, static_cast<int64_t>(m.col_blocks.size()));
  }
  throw std::logic_error("Muon: parameter '" + params_.at(i).name + "' has no matrix");
}

void Muon::clear_state(size_t i) {
  if (uses_muon(i)) {
    radius_[i].zero_();
    if (normuon_v_[i].defined()) normuon_v_[i].zero_();
  }
  if (!uses_muon(i)) {
    exp_avg_[i].zero_();
    exp_avg_sq_[i].zero_();
  } else if (!eight_bit()) {
    momenta_[i].zero_();
  } else {  // zero codes decode to the map's value nearest 0
    momenta_[i].fill_(code_.zero_code());
    absmax_[i].zero_();
  }
}

quant::BlockLayout Muon::block_layout(size_t i) const {
  // The shard starts on a block edge (checked), so its blocks are the global tensor's.
  return quant::BlockLayout(quant::BlockShape::blocks(config_.momentum_block), 1,
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
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (!eight_bit()) {
    out.emplace_back("momentum_buffer", momenta_.at(i));
  } else {
    out.emplace_back("momentum_codes", momenta_.at(i));
    out.emplace_back("momentum_absmax", absmax_.at(i));
  }
  if (config_.normuon) out.emplace_back("normuon_v", normuon_v_.at(i));
  if (hyperball_of(i)) out.emplace_back("hyperball_radius", radius_.at(i));
  return out;
}

std::vector<std::string> Muon::extra_state_names(size_t i) const {
  std::vector<std::string> out;
  if (config_.normuon) out.push_back("normuon_v");
  if (hyperball_of(i)) out.push_back("hyperball_radius");
  return out;
}

NamedState Muon::requantized_state(size_t i, const MuonConfig& saved_config,
                                   const NamedState& full) const {
  if (!uses_muon(i)) return saved_as_kept(i, full, {"exp_avg", "exp_avg_sq"});
  const ParamShard& p = params_.at(i);
  // (NorMuon's v and Hyperball's radius are fp32 whatever the momentum's storage)
  NamedState out = saved_as_kept(i, full, extra_state_names(i));
  at::Tensor whole;  // the flattened global tensor's momentum, fp32
  if (full.count("momentum_codes")) {
    whole = quant::dequantize_blockwise(
        {saved(full, "momentum_codes", name(), p).reshape(-1),
         saved(full, "momentum_absmax", name(), p).reshape(-1)},
        momentum_codec(saved_config.momentum_map),
        quant::BlockShape::blocks(saved_config.momentum_block));
  } else {
    whole = saved(full, "momentum_buffer", name(), p).reshape(-1).to(at::kFloat);
  }
  if (!eight_bit()) {
    out["momentum_buffer"] = rows_here(p, whole).view(p.param.sizes()).to(momenta_.at(i).dtype());
    return out;
  }
  const int64_t block = config_.momentum_block;
  const quant::Quantized q = quant::quantize_blockwise(
      whole.contiguous(), code_, quant::BlockShape::blocks(block));
  out["momentum_codes"] = rows_here(p, q.codes).view(p.param.sizes());
  out["momentum_absmax"] = q.absmax.reshape(-1)
                               .narrow(0, p.row_begin * p.row_len / block, absmax_.at(i).numel())
                               .clone();
  return out;
}

std::vector<StateLayout> Muon::state_layout(size_t i) const {
  if (!uses_muon(i)) return {StateLayout::rows("exp_avg"), StateLayout::rows("exp_avg_sq")};
  const ParamShard& p = params_.at(i);
  std::vector<StateLayout> out;
  if (!eight_bit()) {
    out.push_back(StateLayout::rows("momentum_buffer"));
  } else {
    // Blocks of the flattened global tensor; the shard starts on a block edge (checked).
    const int64_t block = config_.momentum_block;
    out.push_back(StateLayout::rows("momentum_codes"));
    out.push_back(StateLayout::sequence("momentum_absmax", (p.full_numel() + block - 1) / block,
                                        p.row_begin * p.row_len / block));
  }
  if (config_.normuon) {  // per row of each block: rows are never cut between ranks
    const int64_t per_elem_row = v_per_row(i), cols = matrix_cols(i);
    out.push_back(StateLayout::sequence("normuon_v", p.full_numel() / cols * per_elem_row,
                                        p.row_begin * p.row_len / cols * per_elem_row));
  }
  if (hyperball_of(i)) {
    // One value every rank keeps (the same where it holds rows): the first holder writes it.
    const size_t k = static_cast<size_t>(in_muon_.at(i));
    const bool writer = layout_.world() == 1 || layout_.rank() == first_holder(layout_.shards()[k]);
    out.push_back(StateLayout::sequence("hyperball_radius", 1, 0, writer ? 0 : 1));
  }
  return out;
}

void Muon::check_options(const MuonOptions& o) const {
  check_option("Muon", "lr", o.lr, o.lr >= 0, ">= 0");
  check_option("Muon", "momentum", o.momentum, o.momentum >= 0 && o.momentum < 1, "in [0, 1)");
  check_option("Muon", "weight_decay", o.weight_decay, o.weight_decay >= 0, ">= 0");
  if (o.hyperball && o.weight_decay != 0.0) {
    throw std::invalid_argument("Muon: a group with hyperball=True takes no weight decay (Hyperball "
                                "keeps every matrix's norm at its radius instead): set its "
                                "weight_decay to 0, got " + std::to_string(o.weight_decay));
  }
  check_option("Muon", "hyperball_radius", o.hyperball_radius, o.hyperball_radius >= 0,
               ">= 0 (0 or None: the parameter's norm when it first steps)");
  check_option("NorMuon", "beta2", o.normuon_beta2, o.normuon_beta2 >= 0 && o.normuon_beta2 < 1,
               "in [0, 1)");
  check_option("NorMuon", "eps", o.normuon_eps, o.normuon_eps > 0, "> 0");
  const std::string adam = "Muon: the AdamW part (use_muon=False groups)";
  check_option(adam, "betas[0]", o.adam_beta1, o.adam_beta1 >= 0 && o.adam_beta1 < 1, "in [0, 1)");
  check_option(adam, "betas[1]", o.adam_beta2, o.adam_beta2 >= 0 && o.adam_beta2 < 1, "in [0, 1)");
  check_option(adam, "eps", o.adam_eps, o.adam_eps > 0, "> 0");
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

void Muon::skip_newton_schulz_for_test(size_t i, bool skip) {
  if (!uses_muon(i)) throw std::invalid_argument("Muon: " + who(i) + " is not a Muon parameter");
  skip_ns_for_test_.resize(muon_.size(), 0);
  skip_ns_for_test_[static_cast<size_t>(in_muon_[i])] = skip ? 1 : 0;
}

bool Muon::checks_own_gradient(size_t i) const {
  return uses_muon(i) && params_[i].grad.defined() && params_[i].grad.device().is_cpu();
}

void Muon::run_step(StepGate& gate, const std::vector<size_t>& stepping) {
  at::NoGradGuard no_grad;
  const size_t M = muon_.size();
  std::vector<at::Tensor> ps(M), gs(M);
  std::vector<MuonOptions> options(M);
  // How many ranks have each parameter's gradient (summed in the gate's
  // all-reduce): a rank without one takes part with zeros; a parameter no rank
  // has one for is skipped, as torch skips a parameter without a gradient.
  std::vector<int64_t> grad_ranks(M, 0);
  for (size_t k = 0; k < M; ++k) {
    const size_t i = muon_[k];
    ps[k] = params_[i].param;
    gs[k] = params_[i].grad;
    options[k] = options_of(i);
    grad_ranks[k] = gs[k].defined() ? 1 : 0;
    if (!gs[k].defined()) gs[k] = at::zeros(ps[k].sizes(), state_options(i));
  }
  gate.share_counts(&grad_ranks);
  // (collective: every rank checks, a failed one too, and all fail alike)
  gate.guard([&] { check_replicated_grads(gs); });
  const bool on_gpu = !ps.empty() && ps[0].is_cuda();
  NsRun ns{config_.ns_dtype, config_.ns_coefficients,
           config_.batch_newton_schulz.value_or(on_gpu)};
  // (metrics and the check that every matrix ran Newton–Schulz: its runs here)
  std::vector<int64_t> orthogonalised(layout_.matrices().size(), 0);
  ns.orthogonalised = &orthogonalised;
  if (!skip_ns_for_test_.empty()) ns.skip_for_test = &skip_ns_for_test_;
  // The new momentum and the update in fp32 (made when the step needs them); the
  // momentum stored on commit.
  std::vector<at::Tensor> u(M), pending(M), pending_absmax(M);
  const auto make_update_of = [&](size_t k) {
    const size_t i = muon_[k];
    const at::Tensor g = gs[k].contiguous().view(-1);
    const double beta = options[k].momentum;
    if (momenta_[i].scalar_type() == at::kFloat) {
      // torch.optim.Muon's lerps, bit for bit, with one new tensor (as torch's): the new
      // momentum in u, then (Nesterov) g.lerp(it, beta) over it in place; the stored
      // momentum takes the same lerp in place on commit, after every check has passed.
      u[k] = momenta_[i].view(-1).lerp(g, 1.0 - beta);
      if (options[k].nesterov) at::lerp_out(u[k], g, u[k], beta);
      return;
    }
    if (!eight_bit()) {  // bf16: torch's lerp in fp32, stored rounded on commit
      pending[k] = momenta_[i].view(-1).to(at::kFloat).lerp(g, 1.0 - beta);
      u[k] = options[k].nesterov ? g.lerp(pending[k], beta) : pending[k];
      return;
    }
    pending[k] = at::empty_like(momenta_[i]);
    pending_absmax[k] = at::empty_like(absmax_[i]);
    u[k] = at::empty({g.numel()}, g.options().dtype(at::kFloat));
    quant::momentum8bit_step(g.to(at::kFloat), momenta_[i].view(-1), absmax_[i], block_layout(i),
                             code_, static_cast<float>(beta), options[k].nesterov,
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
  // NorMuon and Hyperball take the update's rows after Newton–Schulz (normalised.cpp).
  bool normalise = config_.normuon;
  for (size_t k = 0; k < M; ++k) normalise = normalise || options[k].hyperball;
  const std::function<void(std::vector<MuonPiece>&)> finish = [&](std::vector<MuonPiece>& pieces) {
    apply_normalised(pieces, options, grad_ranks);
  };
  normalise_bytes_ = 0;
  // (A momentum that overflowed makes u, and so Newton–Schulz's result, non-finite:
  // that failure is agreed with the gradients' in the step below, in one all-reduce.)
  muon_step_from_updates(comm_.get(), layout_, ns, options, ps, u, make_update, gate, [&] {
    for (size_t k = 0; k < M; ++k) {
      const size_t i = muon_[k];
      if (grad_ranks[k] == 0) continue;  // no rank had its gradient: unchanged
      if (!pending[k].defined()) {
        momenta_[i].view(-1).lerp_(gs[k].contiguous().view(-1), 1.0 - options[k].momentum);
        continue;
      }
      momenta_[i].view(-1).copy_(pending[k].view(-1));
      if (eight_bit()) absmax_[i].copy_(pending_absmax[k]);
    }
  }, &grad_ranks, normalise ? &finish : nullptr);
  for (size_t m = 0; m < orthogonalised.size(); ++m) {
    work_.at(group_of_[muon_[layout_.matrices()[m].param]]).matrices += orthogonalised[m];
  }
  // The AdamW part: the parameters outside Muon that have a gradient.
  std::vector<AdamWStep> adam;
  for (size_t i : stepping) {
    if (uses_muon(i)) continue;
    const MuonOptions& h = options_of(i);
    adam.push_back({params_[i].param, params_[i].grad, exp_avg_[i], exp_avg_sq_[i], h.lr,
                    h.adam_beta1, h.adam_beta2, h.adam_eps, h.weight_decay, param_steps_[i],
                    group_of_[i]});
  }
  fused_launches_ += adamw_fp32_steps(adam, /*fused_on_cpu=*/false);
}

}  // namespace rfsdp
