// StepGate on 1-3 thread ranks: what one rank found is every rank's error, the
// worst kind first (an invalid argument, a NaN/Inf gradient, an error, then a
// derived result that is not finite), naming the rank.
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>

#include "tests/support/local_ranks.h"
#include "optimizers/common/finite.h"
#include "optimizers/common/step_gate.h"

namespace rfsdp {
namespace {

// What each rank's agree() threw: (kind, message); kind "" where it went on.
std::vector<std::pair<std::string, std::string>> outcomes(int world,
                                                          const std::function<void(StepGate&, int)>& find) {
  std::vector<std::pair<std::string, std::string>> out(world);
  std::mutex mu;
  run_local_ranks(world, [&](Comm& comm) {
    StepGate gate(&comm, "Test step");
    find(gate, comm.rank());
    std::pair<std::string, std::string> got;
    try {
      gate.agree();
    } catch (const std::invalid_argument& e) {
      got = {"invalid", e.what()};
    } catch (const std::runtime_error& e) {
      got = {"error", e.what()};
    }
    std::lock_guard<std::mutex> lock(mu);
    out[comm.rank()] = got;
  });
  return out;
}

// tensor_finite agrees with at::isfinite on fp32 and bf16 tensors, contiguous,
// transposed (dense in another order), strided and on each element: a NaN or an
// Inf anywhere, and the largest finite values, which are finite.
TEST(Finite, EveryDtypeAndLayoutAgreesWithIsfiniteElementByElement) {
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    const at::Tensor base = at::randn({37, 70}).to(dt);
    EXPECT_TRUE(tensor_finite(base));
    const double big = dt == at::kFloat ? 3.4e38 : 3.38e38;
    for (const double bad : {std::nan(""), double(INFINITY), -double(INFINITY), big}) {
      for (int64_t k : {int64_t{0}, int64_t{1}, int64_t{37 * 70 - 1}, int64_t{1000}}) {
        at::Tensor t = base.clone();
        t.view(-1)[k] = bad;
        for (const at::Tensor& v : {t, t.t(), t.narrow(1, 0, 35), t.t().narrow(0, 0, 69)}) {
          const bool want = at::isfinite(v).all().item<bool>();
          ASSERT_EQ(tensor_finite(v), want) << c10::toString(dt) << " value " << bad << " at " << k
                                            << " sizes " << v.sizes() << " strides " << v.strides();
        }
      }
    }
  }
}

TEST(StepGate, NothingFoundAnywhereGoesOn) {
  for (const auto& [kind, msg] : outcomes(3, [](StepGate& g, int) {
         g.check_finite("w", at::randn({5, 3}));
         EXPECT_TRUE(g.guard([] {}));
       })) {
    EXPECT_EQ(kind, "") << msg;
  }
}

TEST(StepGate, TheWorstFindingOfAnyRankIsEveryRanksErrorNamingIt) {
  // rank 0: a NaN gradient; rank 1: an error (thrown inside guard: an owner's
  // eigensolver on rows rank 0 sent it); rank 2: nothing. The gradient is the cause.
  const auto got = outcomes(3, [](StepGate& g, int rank) {
    at::Tensor grad = at::randn({4, 4});
    if (rank == 0) grad[3][3] = std::nan("");
    g.check_finite("layer.weight", grad);
    EXPECT_EQ(g.guard([rank] {
      if (rank == 1) throw std::runtime_error("the root of tile 3 failed");
    }), rank != 1);
  });
  for (const auto& [kind, msg] : got) {
    EXPECT_EQ(kind, "error");
    EXPECT_EQ(msg, got[0].second);
  }
  EXPECT_EQ(got[0].second,
            "Test step: the gradient of parameter 'layer.weight' holds NaN or Inf (on rank 0; rank 1 "
            "failed too); the step was not taken on any rank (check the loss, lower the learning "
            "rate, or clip gradients)");
  // An error outranks a derived result that is not finite (a root's Newton–Schulz
  // of rows other ranks sent), which names its rank only where nothing else failed.
  const auto derived = outcomes(3, [](StepGate& g, int rank) {
    if (rank == 0) g.expect_finite(at::full({2}, NAN), "the result of matrix 0", /*derived=*/true);
    if (rank == 2) g.fail("the root of tile 3 failed");
  });
  for (const auto& [kind, msg] : derived) {
    EXPECT_EQ(msg, "Test step: the root of tile 3 failed (on rank 2; rank 0 failed too); the step "
                   "was not taken on any rank");
  }
  const auto blamed = outcomes(2, [](StepGate& g, int rank) {
    if (rank == 0) g.expect_finite(at::full({2}, NAN), "the result of matrix 0", /*derived=*/true);
    if (rank == 1) g.check_finite("w", at::full({2}, NAN));
  });
  for (const auto& [kind, msg] : blamed) {
    EXPECT_NE(msg.find("the gradient of parameter 'w' holds NaN or Inf (on rank 1; rank 0 failed "
                       "too)"), std::string::npos) << msg;
  }
  const auto alone = outcomes(2, [](StepGate& g, int rank) {
    if (rank == 1) g.expect_finite(at::full({2}, NAN), "the result of matrix 0", /*derived=*/true);
  });
  for (const auto& [kind, msg] : alone) {
    EXPECT_NE(msg.find("the result of matrix 0 (on rank 1)"), std::string::npos) << msg;
  }
  // NaN alone, on ranks 1 and 2: the first names the tensor, the other is counted.
  const auto nan = outcomes(3, [](StepGate& g, int rank) {
    g.check_finite("b", rank > 0 ? at::full({2}, INFINITY) : at::zeros({2}));
  });
  for (const auto& [kind, msg] : nan) EXPECT_EQ(msg, nan[0].second);
  EXPECT_EQ(nan[0].second,
            "Test step: the gradient of parameter 'b' holds NaN or Inf (on rank 1; rank 2 failed "
            "too); the step was not taken on any rank (check the loss, lower the learning rate, "
            "or clip gradients)");
}

// Counts shared in the agreement's all-reduce (Muon: how many ranks have each
// parameter's gradient) are every rank's sums after it, passed or failed.
TEST(StepGate, SharedCountsAreSummedOverTheRanks) {
  std::mutex mu;
  std::vector<std::vector<int64_t>> seen(3);
  for (const bool fail : {false, true}) {
    run_local_ranks(3, [&](Comm& comm) {
      const int r = comm.rank();
      std::vector<int64_t> counts{r == 0 ? 1 : 0, 1, r, 0};
      StepGate gate(&comm, "Test step");
      gate.share_counts(&counts);
      if (fail && r == 2) gate.fail("no");
      try {
        gate.agree();
      } catch (const std::runtime_error&) {
      }
      std::lock_guard<std::mutex> lock(mu);
      seen[r] = counts;
    });
    for (const auto& c : seen) EXPECT_EQ(c, (std::vector<int64_t>{1, 3, 3, 0}));
  }
}

TEST(StepGate, ABadArgumentIsAnInvalidArgumentEverywhereAndOneRankAloneNeedsNoComm) {
  const auto got = outcomes(2, [](StepGate& g, int rank) {
    if (rank == 1) g.fail("ValueError: lr must be >= 0", /*invalid_argument=*/true);
    if (rank == 0) g.fail("something else");  // an error ranks below a bad argument
  });
  for (const auto& [kind, msg] : got) {
    EXPECT_EQ(kind, "invalid");
    EXPECT_NE(msg.find("ValueError: lr must be >= 0 (on rank 1; rank 0 failed too)"),
              std::string::npos) << msg;
  }
  StepGate alone(nullptr, "Solo step");
  alone.check_finite("x", at::full({3}, NAN));
  try {
    alone.agree();
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()),
              "Solo step: the gradient of parameter 'x' holds NaN or Inf; the step was not taken "
              "(check the loss, lower the learning rate, or clip gradients)");
  }
}

}  // namespace
}  // namespace rfsdp
