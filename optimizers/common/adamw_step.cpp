#include "optimizers/common/adamw_step.h"

#include <map>
#include <string>
#include <tuple>

#include "quant/ops.h"

namespace rfsdp {

int64_t adamw_fp32_steps(const std::vector<AdamWStep>& steps, bool fused_on_cpu) {
  // One launch per parameter group, device and dtype, over every tensor of it:
  // torch's _fused_adamw_, what torch.optim.AdamW(fused=True) runs.
  std::map<std::tuple<size_t, std::string, at::ScalarType>, std::vector<const AdamWStep*>> sets;
  for (const AdamWStep& s : steps) {
    if (s.param.is_cuda() || fused_on_cpu) {
      if (s.param.numel() > 0) sets[{s.group, s.param.device().str(), s.param.scalar_type()}].push_back(&s);
      continue;
    }
    quant::cpu::adamw32_step(s.param.data_ptr<float>(), s.grad.data_ptr<float>(),
                             s.m.data_ptr<float>(), s.v.data_ptr<float>(), s.param.numel(),
                             {static_cast<float>(s.lr), static_cast<float>(s.beta1),
                              static_cast<float>(s.beta2), static_cast<float>(s.eps),
                              static_cast<float>(s.weight_decay), s.step});
  }
  for (const auto& [key, members] : sets) {
    const AdamWStep& o = *members[0];
    std::vector<at::Tensor> ps, gs, ms, vs, counts;
    for (const AdamWStep* s : members) {
      ps.push_back(s->param);
      gs.push_back(s->grad);
      ms.push_back(s->m);
      vs.push_back(s->v);
      counts.push_back(at::full({}, static_cast<double>(s->step), s->param.options()));
    }
    at::_fused_adamw_(ps, gs, ms, vs, {}, counts, o.lr, o.beta1, o.beta2, o.weight_decay, o.eps,
                      /*amsgrad=*/false, /*maximize=*/false);
  }
  return static_cast<int64_t>(sets.size());
}

}  // namespace rfsdp
