// Comm on 1-4 ranks as threads over Gloo: every collective against a float64
// reference built from all ranks' (seeded) inputs, the fallback counters, and
// a peer that stops taking part.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "core/comm/agree.h"
#include "core/comm/hybrid_groups.h"
#include "tests/support/local_ranks.h"
#include "tests/cpp/test_util.h"

namespace rfsdp {
namespace {

using testing::fresh_seed;
using testing::seeded_randn;

class CommWorld : public ::testing::TestWithParam<int> {};

TEST_P(CommWorld, AllGatherFlatInPlaceAndFromLocal) {
  const int world = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t S = 37;
  run_local_ranks(world, [&](Comm& comm) {
    for (bool from_local : {false, true}) {
      at::Tensor buf = at::full({world * S}, -7.0f);  // poison
      at::Tensor mine = seeded_randn({S}, seed, comm.rank());
      at::Tensor local;
      if (from_local) {
        local = mine.clone();
      } else {
        buf.narrow(0, comm.rank() * S, S).copy_(mine);
      }
      comm.all_gather_flat(buf, local).wait();
      for (int r = 0; r < world; ++r) {
        ASSERT_TRUE(at::equal(buf.narrow(0, r * S, S), seeded_randn({S}, seed, r)))
            << "rank " << comm.rank() << " slice " << r;
      }
    }
  });
}

TEST_P(CommWorld, ReduceScatterSumAndMean) {
  const int world = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t S = 53;
  run_local_ranks(world, [&](Comm& comm) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) {
      at::Tensor buf = seeded_randn({world * S}, seed, comm.rank());
      at::Tensor out = at::full({S}, 99.0f);
      comm.reduce_scatter_flat(buf, out, op).wait();
      at::Tensor ref = at::zeros({S}, at::kDouble);
      for (int r = 0; r < world; ++r) {
        ref += seeded_randn({world * S}, seed, r, at::kDouble).narrow(0, comm.rank() * S, S);
      }
      if (op == ReduceOp::Avg) ref /= world;
      const double tol = 1e-6 * world;  // fp32 sums of `world` terms, in the backend's order
      ASSERT_TRUE(at::allclose(out.to(at::kDouble), ref, tol, tol))
          << "rank " << comm.rank() << " max err "
          << (out.to(at::kDouble) - ref).abs().max().item<double>();
    }
  });
}

TEST_P(CommWorld, AllToAllWithUnevenSplits) {
  const int world = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  // Rank s sends (s + 2*d + 1) elements to rank d: values s*1000 + d*100 + i.
  auto count = [](int s, int d) { return int64_t{s + 2 * d + 1}; };
  run_local_ranks(world, [&](Comm& comm) {
    const int me = comm.rank();
    std::vector<int64_t> in_splits, out_splits;
    std::vector<at::Tensor> pieces;
    for (int d = 0; d < world; ++d) {
      in_splits.push_back(count(me, d));
      out_splits.push_back(count(d, me));
      pieces.push_back(at::arange(count(me, d), at::kFloat) + (me * 1000 + d * 100));
    }
    at::Tensor in = at::cat(pieces);
    at::Tensor out = at::full({std::accumulate(out_splits.begin(), out_splits.end(), int64_t{0})},
                              -1.0f);
    comm.all_to_all(out, in, out_splits, in_splits).wait();
    int64_t off = 0;
    for (int s = 0; s < world; ++s) {
      at::Tensor want = at::arange(count(s, me), at::kFloat) + (s * 1000 + me * 100);
      ASSERT_TRUE(at::equal(out.narrow(0, off, count(s, me)), want)) << "from " << s;
      off += count(s, me);
    }
  });
}

TEST_P(CommWorld, AllReduceBroadcastBarrier) {
  const int world = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  run_local_ranks(world, [&](Comm& comm) {
    at::Tensor t = seeded_randn({3, 5}, seed, comm.rank());
    comm.all_reduce(t, ReduceOp::Avg).wait();
    at::Tensor ref = at::zeros({3, 5}, at::kDouble);
    for (int r = 0; r < world; ++r) ref += seeded_randn({3, 5}, seed, r, at::kDouble);
    ASSERT_TRUE(at::allclose(t.to(at::kDouble), ref / world, 1e-6, 1e-6));
    const int root = world - 1;
    at::Tensor b = comm.rank() == root ? seeded_randn({11}, seed, 77) : at::zeros({11});
    comm.broadcast(b, root).wait();
    ASSERT_TRUE(at::equal(b, seeded_randn({11}, seed, 77)));
    comm.barrier().wait();
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, CommWorld, ::testing::Values(1, 2, 3, 4, 8, 16, 32));

// Both algorithms of the flat collectives give the same answer, and CommStats
// counts which ran and what each copies.
class CommAlgorithms : public ::testing::TestWithParam<std::tuple<int, FlatAlgorithm>> {};

TEST_P(CommAlgorithms, FlatCollectivesMatchReferenceAndCountWhatRan) {
  const auto [world, algo] = GetParam();
  const int64_t S = 24;
  const uint64_t seed = fresh_seed();
  run_local_ranks(world, [&](Comm& comm) {
    // all-to-all is the reduce-scatter's alone (a gather asked for it is refused)
    const FlatAlgorithm gather_algo = algo == FlatAlgorithm::AllToAll ? FlatAlgorithm::PerRank : algo;
    EXPECT_THROW(comm.set_flat_algorithms(FlatAlgorithm::AllToAll, algo), std::invalid_argument);
    comm.set_flat_algorithms(gather_algo, algo);
    EXPECT_EQ(comm.gather_algorithm(), gather_algo);
    EXPECT_EQ(comm.reduce_scatter_algorithm(), algo);
    const int r = comm.rank();
    at::Tensor buf = at::zeros({world * S});
    at::Tensor local = seeded_randn({S}, seed, r);
    comm.reset_stats();
    comm.all_gather_flat(buf, local).wait();
    for (int k = 0; k < world; ++k) {
      ASSERT_TRUE(at::equal(buf.narrow(0, k * S, S), seeded_randn({S}, seed, k))) << "slice " << k;
    }
    const CommStats g = comm.stats();
    at::Tensor grads = seeded_randn({world * S}, seed, 100 + r), out = at::zeros({S});
    comm.reset_stats();
    comm.reduce_scatter_flat(grads, out, ReduceOp::Avg).wait();
    at::Tensor want = at::zeros({world * S}, at::kDouble);
    for (int k = 0; k < world; ++k) want += seeded_randn({world * S}, seed, 100 + k, at::kDouble);
    want = (want / world).narrow(0, r * S, S);
    ASSERT_TRUE(at::allclose(out.to(at::kDouble), want, 1e-6, 1e-6));
    const CommStats rs = comm.stats();
    const int64_t sb = S * 4;
    EXPECT_EQ(g.bytes_sent, sb);
    EXPECT_EQ(rs.bytes_sent, world * sb);
    if (algo == FlatAlgorithm::AllToAll) {
      // one all-to-all into a scratch of the buffer's size, the pieces summed into out
      EXPECT_EQ(rs.reduce_scatters_all_to_all, 1);
      EXPECT_EQ(rs.collectives, 1);
      EXPECT_EQ(rs.fallbacks, 0);
      EXPECT_EQ(rs.bytes_copied, (world + 1) * sb);
      // in rank order, every element: the float64 sum rounded piece by piece
      at::Tensor ordered = seeded_randn({world * S}, seed, 100).narrow(0, r * S, S).clone();
      for (int k = 1; k < world; ++k) ordered.add_(seeded_randn({world * S}, seed, 100 + k).narrow(0, r * S, S));
      ASSERT_TRUE(at::equal(out, ordered.mul_(1.0 / world)));
    } else if (algo == FlatAlgorithm::PerRank) {
      // m in-place broadcasts after one copy of the local input into the own slice;
      // m reduces, then one copy of the own slice out.
      EXPECT_EQ(g.gathers_per_rank, 1);
      EXPECT_EQ(g.collectives, world);
      EXPECT_EQ(g.bytes_copied, sb);
      EXPECT_EQ(rs.reduce_scatters_per_rank, 1);
      EXPECT_EQ(rs.collectives, world);
      EXPECT_EQ(rs.bytes_copied, sb);
      EXPECT_EQ(g.fallbacks + rs.fallbacks, 2);
    } else {
      // Gloo stages both: the gather copies the input in and every slice out, the
      // reduce-scatter clones the buffer and copies the own slice out.
      EXPECT_EQ(g.gathers_native, 1);
      EXPECT_EQ(rs.reduce_scatters_native, 1);
      EXPECT_EQ(g.collectives + rs.collectives, 2);
      EXPECT_EQ(g.fallbacks + rs.fallbacks, 0);
      EXPECT_EQ(g.bytes_copied, (world + 1) * sb);
      EXPECT_EQ(rs.bytes_copied, (world + 1) * sb);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, CommAlgorithms,
                         ::testing::Combine(::testing::Values(1, 2, 3, 8),
                                            ::testing::Values(FlatAlgorithm::Native,
                                                              FlatAlgorithm::PerRank,
                                                              FlatAlgorithm::AllToAll)));

// Gloo's reduce-scatter left to Auto: per-rank reduces on 2 ranks; beyond, one
// all-to-all for slices up to 4 MiB, per-rank reduces above (chosen per call).
TEST(CommAlgorithms, GlooReduceScatterAutoFollowsRanksAndSliceSize) {
  for (int world : {2, 4}) {
    run_local_ranks(world, [&](Comm& comm) {
      comm.set_flat_algorithms(FlatAlgorithm::Auto, FlatAlgorithm::Auto);
      for (int64_t S : {int64_t{1024}, int64_t{(4 << 20) / 4 + 1}}) {
        at::Tensor buf = at::ones({world * S}), out = at::zeros({S});
        comm.reset_stats();
        comm.reduce_scatter_flat(buf, out, ReduceOp::Sum).wait();
        ASSERT_TRUE(at::equal(out, at::full({S}, static_cast<float>(world))));
        const CommStats st = comm.stats();
        const bool a2a = world > 2 && S * 4 <= (4 << 20);
        EXPECT_EQ(st.reduce_scatters_all_to_all, a2a ? 1 : 0) << world << " ranks, S " << S;
        EXPECT_EQ(st.reduce_scatters_per_rank, a2a ? 0 : 1) << world << " ranks, S " << S;
      }
    });
  }
}

TEST(Comm, Bf16TravelsAndReducesOverGloo) {
  const uint64_t seed = fresh_seed();
  run_local_ranks(2, [&](Comm& comm) {
    const int r = comm.rank();
    const int64_t S = 40;
    at::Tensor buf = at::zeros({2 * S}, at::kBFloat16);
    comm.all_gather_flat(buf, seeded_randn({S}, seed, r).to(at::kBFloat16)).wait();
    for (int k = 0; k < 2; ++k) {
      ASSERT_TRUE(at::equal(buf.narrow(0, k * S, S), seeded_randn({S}, seed, k).to(at::kBFloat16)));
    }
    // Two ranks: the bf16 sum is the float sum rounded once.
    at::Tensor t = seeded_randn({S}, seed, 10 + r).to(at::kBFloat16);
    comm.all_reduce(t, ReduceOp::Sum).wait();
    at::Tensor want = (seeded_randn({S}, seed, 10).to(at::kBFloat16).to(at::kFloat) +
                       seeded_randn({S}, seed, 11).to(at::kBFloat16).to(at::kFloat))
                          .to(at::kBFloat16);
    ASSERT_TRUE(at::equal(t, want));
  });
}

TEST(Comm, PeerThatStopsTakingPartFailsClearly) {
  std::atomic<bool> rank0_done{false};
  const auto errors = run_local_ranks_collect(
      2,
      [&](Comm& comm) {
        if (comm.rank() == 1) {
          // Alive but silent: waits for rank 0 to give up (capped).
          for (int i = 0; i < 600 && !rank0_done; ++i) {
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
          }
          return;
        }
        at::Tensor buf = at::zeros({8});
        try {
          comm.all_gather_flat(buf).wait();
        } catch (...) {
          rank0_done = true;
          throw;
        }
        rank0_done = true;
      },
      std::chrono::milliseconds(1500));
  ASSERT_TRUE(errors[0] != nullptr) << "rank 0 should fail";
  EXPECT_TRUE(errors[1] == nullptr);
  try {
    std::rethrow_exception(errors[0]);
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("did not complete on rank 0 of 2 within 1500 ms"), std::string::npos) << msg;
    EXPECT_NE(msg.find("peer rank stopped taking part"), std::string::npos) << msg;
  }
}

// Ranks that would meet in different collectives (one skipped part of a step)
// raise one error naming what each was doing, where Gloo would abort the
// processes; the same collective on every rank passes its check-in.
TEST(Comm, CollectivesOutOfStepAreAnErrorOnEveryRank) {
  const auto errors = run_local_ranks_collect(2, [&](Comm& comm) {
    EXPECT_TRUE(comm.checks_collectives());
    at::Tensor t = at::ones({3});
    comm.all_reduce(t, ReduceOp::Sum).wait();  // in step
    if (comm.rank() == 0) {
      at::Tensor buf = at::zeros({8});
      comm.all_gather_flat(buf).wait();
    } else {
      at::Tensor x = at::ones({5});
      comm.all_reduce(x, ReduceOp::Sum).wait();
    }
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(errors[r] != nullptr) << "rank " << r << " went on";
    try {
      std::rethrow_exception(errors[r]);
    } catch (const std::runtime_error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("collectives out of step on a group of 2 ranks: rank 0 is at its "
                         "collective #1, all_gather_flat of 8 Float elements; rank 1 is at its "
                         "collective #1, all_reduce of 5 Float elements"),
                std::string::npos) << msg;
    }
  }
}

TEST(Comm, BadArguments) {
  run_local_ranks(2, [&](Comm& comm) {
    EXPECT_THROW(comm.all_gather_flat(at::zeros({7})), std::invalid_argument);
    EXPECT_THROW(comm.all_gather_flat(at::zeros({8}), at::zeros({3})), std::invalid_argument);
    EXPECT_THROW(comm.reduce_scatter_flat(at::zeros({8}), at::zeros({3}), ReduceOp::Sum),
                 std::invalid_argument);
    EXPECT_THROW(comm.all_to_all(at::zeros({4}), at::zeros({4}), {1, 1}, {2, 2}),
                 std::invalid_argument);
    EXPECT_THROW(comm.broadcast(at::zeros({2}), 2), std::invalid_argument);
    EXPECT_THROW(comm.all_gather_flat(at::zeros({4, 2})), std::invalid_argument);
  });
}

TEST(Agree, EveryRankGetsEveryRanksStringAndEqualLinesPass) {
  const uint64_t seed = testing::fresh_seed();
  run_local_ranks(3, [&](Comm& comm) {
    // lengths 0, 1000 and 7, with every byte value (NUL included)
    auto text = [&](int r) {
      std::string out;
      const int64_t n = r == 0 ? 0 : r == 1 ? 1000 : 7;
      for (int64_t i = 0; i < n; ++i) out.push_back(static_cast<char>((seed + 31 * i + r) % 256));
      return out;
    };
    const auto all = all_gather_strings(comm, text(comm.rank()));
    ASSERT_EQ(all.size(), 3u);
    for (int r = 0; r < 3; ++r) EXPECT_EQ(all[r], text(r)) << "rank " << r << "'s string";
    agree_lines(comm, {"tensor 'w' shape [24, 24]", "param dtype Float"}, "unit");  // no throw
  });
}

TEST(Agree, DifferentLinesAreOneErrorOnEveryRankNamingTheFirstDifferenceAndTheRanks) {
  for (int world : {2, 3}) {
    const auto errors = run_local_ranks_collect(world, [&](Comm& comm) {
      std::vector<std::string> lines = {"call 0", "tensor 'w' shape [24, 24]", "tensor 'b' shape [24]"};
      if (comm.rank() == world - 1) lines[1] = "tensor 'w' shape [25, 24]";
      if (comm.rank() == world - 1) lines[2] = "tensor 'b' shape [25]";  // not the first difference
      agree_lines(comm, lines, "fully_shard(Linear)");
    });
    std::string first;
    for (int r = 0; r < world; ++r) {
      ASSERT_TRUE(errors[r]) << "rank " << r << " went on";
      try {
        std::rethrow_exception(errors[r]);
      } catch (const std::invalid_argument& e) {
        const std::string m = e.what();
        if (r == 0) first = m;
        EXPECT_EQ(m, first) << "rank " << r;
        EXPECT_NE(m.find("fully_shard(Linear) differs between ranks: rank 0 has 'tensor 'w' shape "
                         "[24, 24]', rank " + std::to_string(world - 1) +
                         " has 'tensor 'w' shape [25, 24]'"),
                  std::string::npos) << m;
        EXPECT_NE(m.find("ranks that differ from rank 0: " + std::to_string(world - 1) + ")"),
                  std::string::npos) << m;
      }
    }
  }
}

// Every mesh of 4 ranks: each rank's shard and replica groups hold the ranks
// FSDP2's (replicate, shard) mesh gives them, and an all-reduce over either sums
// exactly the members' values (seeded per world rank, checked against float64).
TEST(Comm, HybridGroupsFollowTheMeshLayout) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (int m : {1, 2, 4}) {
    SCOPED_TRACE("shard size " + std::to_string(m));
    run_local_ranks(4, [&](Comm& world) {
      HybridGroups g = hybrid_groups(world, m);
      const int r = world.rank();
      ASSERT_EQ(g.shard->size(), m);
      ASSERT_EQ(g.replicate->size(), 4 / m);
      EXPECT_EQ(g.shard->rank(), r % m);
      EXPECT_EQ(g.replicate->rank(), r / m);
      for (int pass = 0; pass < 2; ++pass) {
        Comm& c = pass == 0 ? *g.shard : *g.replicate;
        at::Tensor x = seeded_randn({53}, seed, r);
        c.all_reduce(x, ReduceOp::Sum).wait();
        at::Tensor want = at::zeros({53}, at::kDouble);
        for (int q = 0; q < 4; ++q) {
          const bool member = pass == 0 ? q / m == r / m : q % m == r % m;
          if (member) want += seeded_randn({53}, seed, q, at::kDouble);
        }
        EXPECT_TRUE(at::allclose(x.to(at::kDouble), want, 1e-6, 1e-6)) << "pass " << pass;
      }
    });
  }
  run_local_ranks(4, [&](Comm& world) {
    EXPECT_THROW(hybrid_groups(world, 3), std::invalid_argument);
    EXPECT_THROW(world.split({0, 0}, "x"), std::invalid_argument);
    EXPECT_THROW(world.split({(world.rank() + 1) % 4}, "y"), std::invalid_argument);
  });
}

}  // namespace
}  // namespace rfsdp
