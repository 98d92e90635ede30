#include "optimizers/common/cut_rows.h"

#include <stdexcept>
#include <string>

#include "core/comm/comm.h"
#include "optimizers/common/step_gate.h"

namespace rfsdp {

OwnerExchange cut_exchange(const char* who, const std::vector<CutTileRow>& cut,
                           const std::vector<ParamShard>& params, Comm* comm) {
  std::vector<ExchangeUnit> units;
  std::vector<std::vector<OwnerExchange::Range>> ranges(params.size());
  for (const CutTileRow& row : cut) {
    units.push_back({row.param, row.begin, row.end, row.owner});
    auto& r = ranges[row.param];
    if (!r.empty()) continue;
    const ParamShard& p = params[row.param];
    if (!comm || comm->size() != static_cast<int>(p.rank_rows.size())) {
      throw std::invalid_argument(
          std::string(who) + ": parameter '" + p.name + "' has rows of tiles that its ranks' "
          "shards cut; the ranks holding one send it to its owner, so the optimizer needs their "
          "process group (" + std::to_string(p.rank_rows.size()) + " ranks; it has " +
          (comm ? std::to_string(comm->size()) : std::string("none")) + ")");
    }
    for (const auto& [b, e] : p.rank_rows) r.emplace_back(b * p.row_len, e * p.row_len);
  }
  return OwnerExchange(comm ? comm->rank() : 0, comm ? comm->size() : 1, std::move(units),
                       std::move(ranges));
}

std::vector<at::Tensor> gather_cut_grads(const OwnerExchange& exchange,
                                         const std::vector<CutTileRow>& cut,
                                         const std::vector<ParamShard>& params,
                                         const std::vector<size_t>& stepping, Comm* comm,
                                         StepGate& gate) {
  if (cut.empty()) return {};  // (every rank has the same rows: none exchanges)
  // Each holder's gradient and a flag per element (1: it steps the parameter):
  // a row whose flags differ has a gradient on some of its ranks only.
  std::vector<bool> has_cut(params.size(), false);
  for (const CutTileRow& row : cut) has_cut[row.param] = true;
  std::vector<at::Tensor> g(params.size()), flag(params.size());
  for (size_t i : stepping) {
    if (!has_cut[i]) continue;
    g[i] = params[i].grad.view({-1});
    flag[i] = at::ones({g[i].numel()}, g[i].options());
  }
  const std::vector<at::Tensor> got = exchange.gather(comm, {g, flag});
  std::vector<at::Tensor> grads(cut.size()), range;  // range: per owned row, min and max flag
  std::vector<size_t> owned;
  for (size_t j = 0; j < cut.size(); ++j) {
    if (!exchange.owns(j)) continue;
    grads[j] = got[j][0];
    range.push_back(at::stack({got[j][1].min(), got[j][1].max()}));
    owned.push_back(j);
  }
  if (owned.empty()) return grads;
  const at::Tensor r = at::stack(range).cpu();
  for (size_t k = 0; k < owned.size(); ++k) {
    if (r[k][0].item<float>() == r[k][1].item<float>()) continue;
    const CutTileRow& row = cut[owned[k]];
    gate.fail("parameter '" + params[row.param].name + "' has a gradient on some of the ranks "
              "that share the row of its tiles [" + std::to_string(row.row0) + ", " +
              std::to_string(row.row0 + row.rows) + ") of matrix " + std::to_string(row.matrix) +
              " and none on others; give every rank a gradient for it (zeros where it has none), "
              "or none on any", true);
    break;
  }
  return grads;
}

}  // namespace rfsdp
