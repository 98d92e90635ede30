#include "optimizers/common/tiled_optimizer.h"

#include <ATen/core/grad_mode.h>

#include <stdexcept>

#include "optimizers/common/step_gate.h"

namespace rfsdp {

void TiledOptimizer::set_up_tiles(const std::vector<bool>& precondition) {
  const size_t n = params_.size();
  if (!precondition.empty() && precondition.size() != n) {
    throw std::invalid_argument(std::string(name()) + ": " + std::to_string(precondition.size()) +
                                " precondition flags for " + std::to_string(n) + " parameters");
  }
  const int rank = comm_ ? comm_->rank() : 0;
  param_tiles_.resize(n);
  factors_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const ParamShard& p = params_[i];
    precondition_.push_back((precondition.empty() || precondition[i]) && p.shape.size() >= 2);
    if (precondition_[i]) {
      for (const Tile& t : matrix_tiles(name(), p, i, tiled_config().max_preconditioner_dim, rank, &cut_)) {
        param_tiles_[i].push_back(tiles_.size());
        tiles_.push_back(t);
      }
    }
  }
  for (size_t i = 0; i < n; ++i) clear_state(i);  // (allocates it)
  exchange_ = cut_exchange(name(), cut_, params_, comm_.get());
}

void TiledOptimizer::clear_state(size_t i) {
  if (precondition_[i]) {
    int64_t left = 0, right = 0;
    for (size_t k : param_tiles_[i]) {
      left += packed_size(tiles_[k].rows);
      right += packed_size(tiles_[k].cols);
    }
    // (factors live with the shard)
    const auto on = at::TensorOptions().dtype(tiled_config().factor_dtype).device(params_[i].param.device());
    factors_[i].left = at::zeros({left}, on);
    factors_[i].right = at::zeros({right}, on);
  }
  clear_moments_and_preconditioner(i);
}

const at::Tensor& TiledOptimizer::factors(size_t i, bool left) const {
  return left ? factors_.at(i).left : factors_.at(i).right;
}

at::Tensor TiledOptimizer::factor(size_t i, size_t k, bool left) const {
  const Tile& t = tiles_[k];
  return factors(i, left).narrow(0, left ? t.left_offset : t.right_offset,
                                 packed_size(left ? t.rows : t.cols));
}

at::Tensor TiledOptimizer::grad_tile(size_t i, const Tile& t) const {
  return tile_view(t.cut >= 0 ? cut_g_[t.cut] : params_[i].grad.view({-1}), t);
}

bool TiledOptimizer::has_cut_rows(size_t i) const {
  for (const CutTileRow& row : cut_) {
    if (row.param == i) return true;
  }
  return false;
}

void TiledOptimizer::run_step(StepGate& gate, const std::vector<size_t>& stepping) {
  at::NoGradGuard no_grad;
  cut_g_ = gather_cut_grads(exchange_, cut_, params_, stepping, comm_.get(), gate);
  for (size_t i : stepping) {  // no eigh or QR of NaN gradients (counted as their failures)
    if (amortises(i)) {
      gate.check_device_now();
      break;
    }
  }
  if (!gate.failed()) gate.guard([&] { prepare(stepping); });
  gate.agree();  // every rank can take the step: from here on it changes state
  for (size_t i : stepping) {  // (metrics: this rank's tiles, cut rows' at their owner)
    StepMetrics::Group& w = work_.at(group_of_[i]);
    const auto n = static_cast<int64_t>(param_tiles_[i].size());
    if (tiles_step(i)) w.tiles += n;
    if (amortises(i)) w.roots += n;
  }
  // A parameter without cut rows finishes at once (its temporaries freed before
  // the next); one with cut rows after the cut rows' exchange.
  std::vector<bool> has_cut(params_.size(), false);
  for (const CutTileRow& row : cut_) has_cut[row.param] = true;
  for (size_t i : stepping) {
    begin(i);
    if (!has_cut[i]) finish(i);
  }
  if (cut_.empty()) return;
  step_cut_rows(stepping);
  for (size_t i : stepping) {
    if (has_cut[i]) finish(i);
  }
}

void TiledOptimizer::step_cut_rows(const std::vector<size_t>& stepping) {
  const CutRowFields fields = cut_row_fields();
  const std::vector<at::Tensor> in = exchange_.gather(comm_.get(), fields.to_owner);
  std::vector<at::Tensor> out(cut_.size());
  for (size_t c = 0; c < cut_.size(); ++c) {
    if (exchange_.owns(c)) out[c] = cut_row_result(in[c]);
  }
  for (size_t i : stepping) {
    if (!tiles_step(i)) continue;
    const std::vector<size_t>& ks = param_tiles_[i];
    for (size_t j = 0; j < ks.size(); ++j) {
      const int64_t c = tiles_[ks[j]].cut;
      if (c >= 0) cut_tile_step(i, j, in[c], out[c]);
    }
  }
  exchange_.scatter(comm_.get(), out, fields.back);
}

std::vector<std::pair<std::string, at::Tensor>> TiledOptimizer::state(size_t i) const {
  auto out = moments_state(i);
  if (precondition_.at(i)) {
    out.insert(out.end(), {{"factor_left", factors_[i].left}, {"factor_right", factors_[i].right}});
    const auto own = preconditioner_state(i);
    out.insert(out.end(), own.begin(), own.end());
  }
  return out;
}

std::vector<StateLayout> TiledOptimizer::state_layout(size_t i) const {
  TileRange r;
  if (precondition_.at(i)) r = tile_range(params_.at(i), tiled_config().max_preconditioner_dim);
  std::vector<StateLayout> out;
  if (precondition_[i]) {
    for (bool left : {true, false}) {
      out.push_back(tile_sequence(left ? "factor_left" : "factor_right", r,
                                  [left](const Tile& t) { return packed_size(left ? t.rows : t.cols); }));
    }
  }
  own_layout(i, r, &out);
  return out;
}

NamedState TiledOptimizer::requantized_state(size_t i, const TiledConfig& saved,
                                             const NamedState& full) const {
  // (a parameter that is not preconditioned keeps fp32 moments: Adam alone)
  if (!precondition_.at(i)) return saved_as_kept(i, full, {"exp_avg", "exp_avg_sq"});
  const ParamShard& p = params_.at(i);
  if (p.col_parts > 1) {  // (its tiles' saved sequences are in the global order, not the parts')
    throw std::invalid_argument(
        std::string(name()) + ": parameter '" + p.name + "' is held in " +
        std::to_string(p.col_parts) + " column parts (tensor parallelism's Shard(1)): moving its "
        "saved state to other storage settings is not supported there; load it with the "
        "settings it was saved with");
  }
  const TileRange r = tile_range(params_.at(i), tiled_config().max_preconditioner_dim);
  NamedState out = saved_as_kept(i, full, {"factor_left", "factor_right"});  // as saved
  out.merge(requantized_own(i, saved, full, r));
  return out;
}

}  // namespace rfsdp
