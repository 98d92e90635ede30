// The owner exchange (optimizers/common/owner_exchange.h) on 1-4 thread ranks,
// element by element against the full tensors: units of a source split raggedly
// over the ranks and of a replicated one, two fields a trip; gather gives each
// owner its units whole, scatter gives every holder its piece of the owner's
// result (a replicated unit: all of it) and touches nothing else.
#include <gtest/gtest.h>

#include <random>

#include "core/comm/comm.h"
#include "optimizers/common/owner_exchange.h"
#include "tests/support/local_ranks.h"

namespace rfsdp {
namespace {

using Range = OwnerExchange::Range;

class OwnerExchangeRanks : public ::testing::TestWithParam<int> {};

TEST_P(OwnerExchangeRanks, GatherAndScatterMoveEveryPieceAndNothingElse) {
  const int world = GetParam();
  const int64_t n0 = 37, n1 = 20;  // source 0: split raggedly; source 1: replicated
  std::mt19937 rng(1234 + world);
  // Rank boundaries of source 0: sorted cuts in [0, n0], some ranks empty.
  std::vector<int64_t> cuts{0};
  for (int r = 1; r < world; ++r) cuts.push_back(std::uniform_int_distribution<int64_t>(0, n0)(rng));
  cuts.push_back(n0);
  std::sort(cuts.begin(), cuts.end());
  std::vector<std::vector<Range>> ranges(2);
  for (int r = 0; r < world; ++r) {
    ranges[0].push_back({cuts[r], cuts[r + 1]});
    ranges[1].push_back({0, n1});
  }
  const std::vector<ExchangeUnit> units = {
      {0, 0, 10, 0}, {0, 10, 25, 1 % world}, {0, 25, 37, world - 1},
      {1, 0, 8, 0}, {1, 8, 20, world - 1}};
  // Field f of source s, full: s * 100 + f * 1000 + element.
  auto full = [&](size_t s, int f) {
    return at::arange(s == 0 ? n0 : n1, at::kFloat) + static_cast<float>(s * 100 + f * 1000);
  };
  run_local_ranks(world, [&](Comm& comm) {
    const int me = comm.rank();
    OwnerExchange ex(me, world, units, ranges, {false, true});
    std::vector<std::vector<at::Tensor>> fields(2), out(2);
    for (int f = 0; f < 2; ++f) {
      for (size_t s = 0; s < 2; ++s) {
        const auto [b, e] = ranges[s][me];
        fields[f].push_back(full(s, f).narrow(0, b, e - b).clone());
        out[f].push_back(at::full({e - b}, -7.0f));
      }
    }
    const std::vector<at::Tensor> got = ex.gather(&comm, fields);
    std::vector<at::Tensor> results(units.size());
    for (size_t u = 0; u < units.size(); ++u) {
      const ExchangeUnit& x = units[u];
      ASSERT_EQ(got[u].defined(), x.owner == me) << "unit " << u;
      if (x.owner != me) continue;
      for (int f = 0; f < 2; ++f) {
        EXPECT_TRUE(at::equal(got[u][f], full(x.source, f).narrow(0, x.begin, x.numel())))
            << "unit " << u << " field " << f << " on rank " << me;
      }
      results[u] = got[u] * 2 + 1;  // the owner's work
    }
    ex.scatter(&comm, results, out);
    for (size_t s = 0; s < 2; ++s) {
      const auto [b, e] = ranges[s][me];
      for (int f = 0; f < 2; ++f) {
        at::Tensor want = at::full({e - b}, -7.0f);  // untouched outside every unit
        for (const ExchangeUnit& x : units) {
          if (x.source != s) continue;
          const int64_t lo = std::max(b, x.begin), hi = std::min(e, x.end);
          if (lo < hi) want.narrow(0, lo - b, hi - lo).copy_(full(s, f).narrow(0, lo, hi - lo) * 2 + 1);
        }
        EXPECT_TRUE(at::equal(out[f][s], want)) << "source " << s << " field " << f << " rank " << me;
      }
    }
    // What travels: a replicated unit's owner receives nothing and sends it whole.
    int64_t sent = 0;
    for (size_t u = 0; u < units.size(); ++u) {
      const Range g = ex.gather_piece(u, me);
      if (units[u].owner != me) sent += g.second - g.first;
      if (units[u].source == 1 && units[u].owner != me) EXPECT_EQ(g.first, g.second);
    }
    EXPECT_EQ(ex.gather_send_elems(), sent);
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, OwnerExchangeRanks, ::testing::Values(1, 2, 3, 4, 8, 16, 32));

}  // namespace
}  // namespace rfsdp
