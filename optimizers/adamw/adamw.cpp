#include "optimizers/adamw/adamw.h"

#include <map>
#include <tuple>
#include <stdexcept>
#include <string>
#include <utility>

#include "quant/blockwise/code_maps.h"
#include "quant/blockwise/cpu_kernels.h"
#include "quant/blockwise/cuda_ops.h"

namespace rfsdp {

namespace {

quant::AdamWHyper hyper(const AdamWOptions& o, int64_t step) {
  return {static_cast<float>(o.lr), static_cast<float>(o.beta1), static_cast<float>(o.beta2),
          static_cast<float>(o.eps), static_cast<float>(o.weight_decay), step};
}

}  // namespace

void AdamW::check_options(const AdamWOptions& o) const {
  if (!(o.lr >= 0) || !(o.eps > 0) || !(o.beta1 >= 0 && o.beta1 < 1) ||
      !(o.beta2 >= 0 && o.beta2 < 1) || !(o.weight_decay >= 0)) {
    throw std::invalid_argument(std::string(name()) +
                                ": need lr >= 0, eps > 0, 0 <= betas < 1, weight_decay >= 0; got "
                                "lr=" + std::to_string(o.lr) + ", eps=" + std::to_string(o.eps) +
                                ", betas=(" + std::to_string(o.beta1) + ", " +
                                std::to_string(o.beta2) + "), weight_decay=" +
                                std::to_string(o.weight_decay));
  }
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
    m_.push_back(fp32 ? at::zeros_like(params_[i].param) : at::Tensor());
    v_.push_back(fp32 ? at::zeros_like(params_[i].param) : at::Tensor());
  }
}

namespace {
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
  std::vector<size_t> fused;  // fp32 moments on a GPU (or fused_on_cpu): torch's fused kernel
  for (size_t i : stepping) {
    if (m_[i].defined() && (params_[i].param.is_cuda() || fused_on_cpu_)) {
      fused.push_back(i);
    } else {
      update(i, param_steps_[i]);
    }
  }
  fused_update(fused);
}

void AdamW::fused_update(const std::vector<size_t>& idx) {
  // One launch per parameter group, device and dtype, over every tensor of it:
  // torch's _fused_adamw_, what torch.optim.AdamW(fused=True) runs.
  std::map<std::tuple<size_t, std::string, at::ScalarType>, std::vector<size_t>> sets;
  for (size_t i : idx) {
    const at::Tensor& p = params_[i].param;
    if (p.numel() > 0) sets[{group_of_[i], p.device().str(), p.scalar_type()}].push_back(i);
  }
  for (const auto& [key, members] : sets) {
    const AdamWOptions& o = groups_[std::get<0>(key)];
    std::vector<at::Tensor> ps, gs, ms, vs, steps;
    for (size_t i : members) {
      ps.push_back(params_[i].param);
      gs.push_back(params_[i].grad);
      ms.push_back(m_[i]);
      vs.push_back(v_[i]);
      steps.push_back(at::full({}, static_cast<double>(param_steps_[i]),
                               params_[i].param.options()));
    }
    at::_fused_adamw_(ps, gs, ms, vs, {}, steps, o.lr, o.beta1, o.beta2, o.weight_decay, o.eps,
                      /*amsgrad=*/false, /*maximize=*/false);
    ++fused_launches_;
  }
}

void AdamW::update(size_t i, int64_t step) {
  ParamShard& p = params_[i];
  quant::cpu::adamw32_step(p.param.data_ptr<float>(), p.grad.data_ptr<float>(),
                           m_[i].data_ptr<float>(), v_[i].data_ptr<float>(), p.param.numel(),
                           hyper(options_of(i), step));
}

std::vector<std::pair<std::string, at::Tensor>> AdamW::state(size_t i) const {
  return {{"exp_avg", m_.at(i)}, {"exp_avg_sq", v_.at(i)}};
}

int64_t AdamW::state_bytes() const {
  int64_t b = 0;
  for (size_t i = 0; i < m_.size(); ++i) b += (m_[i].numel() + v_[i].numel()) * 4;
  return b;
}

AdamW8bit::AdamW8bit(std::vector<ParamShard> params, AdamWOptions options,
                     quant::BlockShape block, int64_t min_8bit_size, std::shared_ptr<Comm> comm)
    : AdamW(params, options, std::move(comm), small_tensors(params, min_8bit_size)),
      block_(block) {
  block_.check();
  code1_ = quant::dynamic_map(true);
  code2_ = quant::dynamic_map(false);
  lut1_ = quant::code_lut(code1_);
  lut2_ = quant::code_lut(code2_);
  for (size_t i = 0; i < params_.size(); ++i) {
    const ParamShard& p = params_[i];
    const bool eight = p.full_numel() >= min_8bit_size;
    eight_bit_.push_back(eight);
    Quantized8 q;
    if (eight) {
      try {
        quant::check_whole_blocks(block_, p.name, p.full_rows, p.row_len, p.row_begin, p.rows());
      } catch (const std::invalid_argument& e) {
        throw std::invalid_argument(std::string("AdamW8bit: ") + e.what());
      }
      q.layout = quant::BlockLayout(block_, p.rows(), p.row_len);
      const auto dev = p.param.options();
      q.q1 = at::full({p.param.numel()}, lut1_->nearest(0.0f), dev.dtype(at::kByte));
      q.q2 = at::full({p.param.numel()}, lut2_->nearest(0.0f), dev.dtype(at::kByte));
      q.absmax1 = at::zeros({q.layout.num_blocks}, dev);
      q.absmax2 = at::zeros({q.layout.num_blocks}, dev);
      if (p.param.is_cuda()) {
        if (!quant::cuda_ops::built()) {
          throw std::invalid_argument("AdamW8bit: parameter '" + p.name + "' is on " +
                                      p.param.device().str() + ", and this build of rfsdp has no "
                                      "CUDA kernels (nvcc was not found when it was built); "
                                      "rebuild with the CUDA toolkit, or use AdamW");
        }
        if (code1_on_.defined() && code1_on_.device() != p.param.device()) {
          throw std::invalid_argument("AdamW8bit: parameters on " + code1_on_.device().str() +
                                      " and " + p.param.device().str() +
                                      "; build one optimizer per GPU");
        }
        if (!code1_on_.defined()) {
          code1_on_ = code1_.to(p.param.device());
          code2_on_ = code2_.to(p.param.device());
        }
      }
    }
    q_.push_back(q);
  }
}

void AdamW8bit::update(size_t i, int64_t step) {
  if (!eight_bit_[i]) return AdamW::update(i, step);
  ParamShard& p = params_[i];
  Quantized8& q = q_[i];
  if (p.param.numel() == 0) return;
  if (p.param.is_cuda()) {
    quant::cuda_ops::adamw8bit_step(p.param, p.grad, q.q1, q.absmax1, q.q2, q.absmax2, q.layout,
                                    code1_on_, *lut1_, code2_on_, *lut2_,
                                    hyper(options_of(i), step));
    return;
  }
  quant::cpu::adamw8bit_step(p.param.data_ptr<float>(), p.grad.data_ptr<float>(),
                             q.q1.data_ptr<uint8_t>(), q.absmax1.data_ptr<float>(),
                             q.q2.data_ptr<uint8_t>(), q.absmax2.data_ptr<float>(), q.layout,
                             *lut1_, *lut2_, hyper(options_of(i), step));
}

namespace {
at::Tensor dequantized(const at::Tensor& q, const at::Tensor& absmax,
                       const quant::BlockLayout& layout, const quant::cpu::CodeLut& lut,
                       const at::Tensor& code_on_device, at::IntArrayRef shape) {
  at::Tensor out = at::empty({q.numel()}, absmax.options());
  if (q.is_cuda()) {
    quant::cuda_ops::dequantize(q, absmax, layout, code_on_device, out);
  } else {
    quant::cpu::dequantize(q.data_ptr<uint8_t>(), absmax.data_ptr<float>(), layout, lut,
                           out.data_ptr<float>());
  }
  return out.view(shape);
}
}  // namespace

at::Tensor AdamW8bit::exp_avg(size_t i) const {
  if (!eight_bit_.at(i)) return m_[i];
  return dequantized(q_[i].q1, q_[i].absmax1, q_[i].layout, *lut1_, code1_on_,
                     params_[i].param.sizes());
}

at::Tensor AdamW8bit::exp_avg_sq(size_t i) const {
  if (!eight_bit_.at(i)) return v_[i];
  return dequantized(q_[i].q2, q_[i].absmax2, q_[i].layout, *lut2_, code2_on_,
                     params_[i].param.sizes());
}

std::vector<std::pair<std::string, at::Tensor>> AdamW8bit::state(size_t i) const {
  if (!eight_bit_.at(i)) return AdamW::state(i);
  return {{"q1", q_[i].q1}, {"absmax1", q_[i].absmax1}, {"q2", q_[i].q2}, {"absmax2", q_[i].absmax2}};
}

int64_t AdamW8bit::state_bytes() const {
  int64_t b = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (eight_bit_[i]) {
      b += q_[i].q1.numel() + q_[i].q2.numel() + (q_[i].absmax1.numel() + q_[i].absmax2.numel()) * 4;
    } else {
      b += (m_[i].numel() + v_[i].numel()) * 4;
    }
  }
  return b;
}

}  // namespace rfsdp
