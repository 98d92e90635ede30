#include "optimizers/common/lpt.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>

namespace rfsdp {

std::vector<int> assign_lpt(const std::vector<WorkItem>& items, int world,
                            std::vector<double>* load_out) {
  if (world < 1) throw std::invalid_argument("assign_lpt: world must be >= 1");
  std::vector<double> load(world, 0.0);
  std::vector<int> rank(items.size(), -1);
  std::vector<size_t> free;
  for (size_t k = 0; k < items.size(); ++k) {
    const WorkItem& it = items[k];
    if (it.fixed_rank >= world || (!it.affinity.empty() && it.affinity.size() != size_t(world))) {
      throw std::invalid_argument("assign_lpt: item " + std::to_string(k) +
                                  " names a rank outside the world of " + std::to_string(world));
    }
    if (it.fixed_rank >= 0) {
      rank[k] = it.fixed_rank;
      load[it.fixed_rank] += it.cost;
    } else {
      free.push_back(k);
    }
  }
  std::stable_sort(free.begin(), free.end(),
                   [&](size_t a, size_t b) { return items[a].cost > items[b].cost; });
  for (size_t k : free) {
    const auto& aff = items[k].affinity;
    auto affinity = [&](int r) { return aff.empty() ? int64_t{0} : aff[r]; };
    const bool only = items[k].holders_only && !aff.empty();
    int best = -1;
    for (int r = 0; r < world; ++r) {
      if (only && aff[r] <= 0) continue;
      if (best < 0 || load[r] < load[best] ||
          (load[r] == load[best] && affinity(r) > affinity(best))) {
        best = r;
      }
    }
    if (best < 0) {
      throw std::invalid_argument("assign_lpt: item " + std::to_string(k) +
                                  " may go only to its holders, and no rank holds it");
    }
    rank[k] = best;
    load[best] += items[k].cost;
  }
  if (load_out) *load_out = load;
  return rank;
}

}  // namespace rfsdp
