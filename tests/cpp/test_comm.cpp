// Comm on 1-4 ranks as threads over Gloo: every collective against a float64
// reference built from all ranks' (seeded) inputs, the fallback counters, and
// a peer that stops taking part.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "core/comm/local_ranks.h"
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
      ASSERT_TRUE(at::allclose(out.to(at::kDouble), ref, 1e-6, 1e-6))
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

INSTANTIATE_TEST_SUITE_P(Ranks, CommWorld, ::testing::Values(1, 2, 3, 4));

TEST(Comm, FallbackCountersOnThisBackend) {
  const int64_t S = 16;
  run_local_ranks(2, [&](Comm& comm) {
    at::Tensor buf = at::zeros({2 * S});
    at::Tensor local = at::ones({S});
    comm.all_gather_flat(buf, local).wait();
    at::Tensor out = at::zeros({S});
    comm.reduce_scatter_flat(buf, out, ReduceOp::Sum).wait();
    const CommStats st = comm.stats();
    if (comm.native_all_gather() && comm.native_reduce_scatter()) {
      // A backend with both native operations: no copy at all.
      EXPECT_EQ(st.fallbacks, 0);
      EXPECT_EQ(st.bytes_copied, 0);
    } else {
      // Gloo in torch 1.13 has neither: all-gather = 2 in-place broadcasts, after one
      // copy of the local input into the rank's slice (S floats); reduce-scatter = 2
      // reduces, then one copy out (S floats).
      EXPECT_FALSE(comm.native_all_gather());
      EXPECT_FALSE(comm.native_reduce_scatter());
      EXPECT_EQ(st.fallbacks, 2);
      EXPECT_EQ(st.collectives, 4);
      EXPECT_EQ(st.bytes_copied, 2 * S * 4);
    }
    EXPECT_EQ(st.bytes_sent, S * 4 + 2 * S * 4);
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

}  // namespace
}  // namespace rfsdp
