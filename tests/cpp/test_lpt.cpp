// assign_lpt: fixed items stay, the load bound of LPT holds against the optimum's
// lower bound on random instances, ties go to affinity then the lowest rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "optimizers/common/lpt.h"
#include "tests/cpp/test_util.h"

namespace rfsdp {
namespace {

// The optimum's largest load by trying every assignment (small instances only).
double optimum(const std::vector<WorkItem>& items, int world) {
  std::vector<int> assign(items.size(), 0);
  double best = 1e300;
  while (true) {
    std::vector<double> load(world, 0.0);
    for (size_t k = 0; k < items.size(); ++k) load[assign[k]] += items[k].cost;
    best = std::min(best, *std::max_element(load.begin(), load.end()));
    size_t k = 0;
    while (k < items.size() && ++assign[k] == world) assign[k++] = 0;
    if (k == items.size()) return best;
  }
}

TEST(Lpt, LargestLoadWithinGrahamsBoundOfTheOptimum) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  int worse_than_optimum = 0;
  for (int c = 0; c < 300; ++c) {
    const int world = 1 + static_cast<int>(rng() % 3);
    std::vector<WorkItem> items(1 + rng() % 8);
    for (auto& it : items) it.cost = 1.0 + static_cast<double>(rng() % 100);
    std::vector<double> load;
    const std::vector<int> rank = assign_lpt(items, world, &load);
    std::vector<double> recount(world, 0.0);
    for (size_t k = 0; k < items.size(); ++k) {
      ASSERT_GE(rank[k], 0);
      ASSERT_LT(rank[k], world);
      recount[rank[k]] += items[k].cost;
    }
    ASSERT_EQ(recount, load);
    const double opt = optimum(items, world);
    const double worst = *std::max_element(load.begin(), load.end());
    ASSERT_LE(worst, (4.0 / 3.0 - 1.0 / (3.0 * world)) * opt * (1 + 1e-12)) << "case " << c;
    if (worst > opt) ++worse_than_optimum;
  }
  // LPT is a heuristic: some random instances must show it (or the bound is idle).
  EXPECT_GT(worse_than_optimum, 0);
}

TEST(Lpt, FixedItemsStayAndCount) {
  std::vector<WorkItem> items(4);
  items[0] = {10.0, 2, {}};
  items[1] = {3.0, -1, {}};
  items[2] = {3.0, -1, {}};
  items[3] = {5.0, -1, {}};
  std::vector<double> load;
  const auto rank = assign_lpt(items, 3, &load);
  EXPECT_EQ(rank[0], 2);
  EXPECT_EQ(rank[3], 0);  // costliest free item first, to rank 0 (ranks 0 and 1 empty)
  EXPECT_EQ(rank[1], 1);  // then rank 1 (empty)
  EXPECT_EQ(rank[2], 1);  // rank 1 (3) is lighter than rank 0 (5) and rank 2 (10)
  EXPECT_EQ(load, (std::vector<double>{5.0, 6.0, 10.0}));
}

TEST(Lpt, TiesGoToAffinityThenTheLowestRank) {
  std::vector<WorkItem> items(2);
  items[0] = {4.0, -1, {0, 7, 7}};  // equal loads: highest affinity, lowest such rank
  items[1] = {4.0, -1, {}};         // ranks 0 and 2 empty: the lowest
  const auto rank = assign_lpt(items, 3);
  EXPECT_EQ(rank[0], 1);
  EXPECT_EQ(rank[1], 0);
  EXPECT_THROW(assign_lpt({{1.0, 3, {}}}, 3), std::invalid_argument);
  EXPECT_THROW(assign_lpt({{1.0, -1, {1, 2}}}, 3), std::invalid_argument);
  EXPECT_THROW(assign_lpt({}, 0), std::invalid_argument);
}

}  // namespace
}  // namespace rfsdp
