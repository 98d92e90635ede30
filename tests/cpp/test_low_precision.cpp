// What every optimizer's base does for its parameters: rebinding one whose
// storage was replaced (the step then updates the new tensor, with the state
// kept; another device or shape is refused), and bfloat16 / float16 parameters
// (the float32 step on an exact upcast, rounded back: to nearest, or
// stochastically to one of the two neighbours, unbiased, with noise that depends
// on the element's place in the global tensor alone).
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "optimizers/adamw/adamw.h"
#include "optimizers/common/low_precision.h"
#include "optimizers/muon/muon.h"
#include "tests/cpp/test_util.h"

namespace rfsdp {
namespace {

using testing::fresh_seed;
using testing::seeded_randn;

TEST(SetParam, AStepUpdatesTheNewTensorWithTheStateKept) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const at::Tensor w0 = seeded_randn({5, 7}, seed, 0);
  // Reference: one optimizer, one tensor, three steps.
  at::Tensor ref = w0.clone();
  AdamW a({whole_param("w", ref, at::Tensor())});
  // Rebound after the first step to a copy (as model.to() makes).
  at::Tensor first = w0.clone();
  AdamW b({whole_param("w", first, at::Tensor())});
  at::Tensor moved;
  for (int step = 0; step < 3; ++step) {
    const at::Tensor g = seeded_randn({5, 7}, seed, 1 + step);
    if (step == 1) {
      moved = first.clone();
      b.set_param(0, moved);
    }
    a.set_grad(0, g);
    b.set_grad(0, g);
    a.step();
    b.step();
  }
  EXPECT_TRUE(at::equal(moved, ref));
  EXPECT_FALSE(at::equal(first, ref)) << "the old tensor stopped at the rebinding";
  EXPECT_THROW(b.set_param(0, at::zeros({5, 6})), std::invalid_argument);
  EXPECT_THROW(b.set_param(0, at::zeros({5, 7}, at::kDouble)), std::invalid_argument);
  try {  // (a move to a GPU is refused alike: "moved from cpu to cuda:0")
    b.set_param(0, at::zeros({5, 7}, at::kMeta));
    ADD_FAILURE() << "a tensor on another device was taken";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("on the CPU or a CUDA device"), std::string::npos)
        << e.what();
  }
}

// The float32 optimizer on the upcast values, rounded to nearest: a bf16 / fp16
// parameter's step, bit for bit; its states are float32. Muon too (its own step).
TEST(LowPrecision, AStepIsTheFloat32StepRoundedToNearest) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (at::ScalarType dt : {at::kBFloat16, at::kHalf}) {
    at::Tensor low = seeded_randn({6, 9}, seed, 0).to(dt);
    at::Tensor twin = low.to(at::kFloat);
    AdamW a({whole_param("w", low, at::Tensor())});
    AdamW b({whole_param("w", twin, at::Tensor())});
    at::Tensor mlow = seeded_randn({6, 9}, seed, 9).to(dt);
    at::Tensor mtwin = mlow.to(at::kFloat);
    Muon ma({whole_param("m", mlow, at::Tensor())});
    Muon mb({whole_param("m", mtwin, at::Tensor())});
    for (int step = 0; step < 4; ++step) {
      const at::Tensor g = seeded_randn({6, 9}, seed, 1 + step).to(dt);
      twin.copy_(low);
      mtwin.copy_(mlow);
      a.set_grad(0, g);
      b.set_grad(0, g.to(at::kFloat));
      ma.set_grad(0, g);
      mb.set_grad(0, g.to(at::kFloat));
      a.step();
      b.step();
      ma.step();
      mb.step();
      ASSERT_TRUE(at::equal(low, twin.to(dt))) << "step " << step;
      ASSERT_TRUE(at::equal(mlow, mtwin.to(dt))) << "step " << step;
      ASSERT_EQ(low.scalar_type(), dt);
    }
    for (const auto& [name, t] : a.state(0)) EXPECT_EQ(t.scalar_type(), at::kFloat) << name;
  }
  EXPECT_THROW(AdamW({whole_param("d", at::zeros({3}, at::kDouble), at::Tensor())}),
               std::invalid_argument);
}

TEST(LowPrecision, StochasticRoundingTakesANeighbourInProportionAndIsPlaceDeterministic) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t n = 200000;
  const at::Tensor x = seeded_randn({n}, seed, 0);
  for (at::ScalarType dt : {at::kBFloat16, at::kHalf}) {
    at::Tensor out = at::empty({n}, dt);
    round_into(out, x, Rounding::kStochastic, seed, 3, 7, 1000);
    // Each result is x's nearest value y or z, the one on x's other side (the bit
    // pattern one step further from or nearer to 0), z with probability |x-y|/|z-y|.
    const at::Tensor y = x.to(dt), xd = x.to(at::kDouble), yd = y.to(at::kDouble);
    const at::Tensor bits = y.view(at::kShort);
    const at::Tensor z = at::where(xd.abs() > yd.abs(), bits + 1, bits - 1).to(at::kShort).view(dt);
    const at::Tensor zd = z.to(at::kDouble);
    const at::Tensor took_z = at::ne(out, y);
    ASSERT_TRUE(at::logical_or(at::eq(out, y), at::eq(out, z)).all().item<bool>());
    ASSERT_FALSE(at::logical_and(took_z, at::eq(yd, xd)).any().item<bool>()) << "an exact value moved";
    const at::Tensor p = ((xd - yd) / (zd - yd)).abs().masked_fill(at::eq(yd, xd), 0.0);
    const double want = p.sum().item<double>(), sd = (p * (1 - p)).sum().sqrt().item<double>();
    EXPECT_LT(std::fabs(took_z.sum().item<double>() - want), 6 * sd + 1) << c10::toString(dt);
    // The noise depends on (seed, salt, counter, element): the same piece rounded
    // from a shard that starts elsewhere gets the same result.
    at::Tensor part = at::empty({n - 500}, dt);
    round_into(part, x.narrow(0, 500, n - 500).contiguous(), Rounding::kStochastic, seed, 3, 7,
               1500);
    EXPECT_TRUE(at::equal(part, out.narrow(0, 500, n - 500)));
    at::Tensor other = at::empty({n}, dt);
    round_into(other, x, Rounding::kStochastic, seed, 3, 8, 1000);  // the next step's noise
    EXPECT_FALSE(at::equal(other, out));
  }
  const at::Tensor u = rounding_noise(seed, 1, 2, 0, n, at::TensorOptions());
  EXPECT_GE(u.min().item<float>(), 0.0f);
  EXPECT_LT(u.max().item<float>(), 1.0f);
  EXPECT_NEAR(u.mean().item<double>(), 0.5, 6 * std::sqrt(1.0 / 12 / n));
}

}  // namespace
}  // namespace rfsdp
