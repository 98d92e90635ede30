// Balanced assignment of work items to ranks: longest processing time first
// (LPT). Muon roots its matrices' Newton-Schulz this way; Shampoo's root
// computations and HSDP's replica work will too.
#pragma once

#include <cstdint>
#include <vector>

namespace rfsdp {

struct WorkItem {
  double cost = 0.0;
  int fixed_rank = -1;            // >= 0: the item must run there (its cost still counts)
  std::vector<int64_t> affinity;  // optional, per rank: breaks load ties (higher wins)
  bool holders_only = false;      // only ranks with affinity > 0 may take it (some must)
};

// The rank of every item. Fixed items stay; the others, costliest first (ties
// in input order), go to the least-loaded rank, ties to the highest affinity,
// then the lowest rank. For identical ranks and no fixed items the largest load
// is at most 4/3 of the optimum's. `load` (if given) receives each rank's total.
std::vector<int> assign_lpt(const std::vector<WorkItem>& items, int world,
                            std::vector<double>* load = nullptr);

}  // namespace rfsdp
