// FSDPUnit on 1-4 ranks as threads: exact unshard, reduce-scatter against a
// float64 reference, training equivalence with one rank, sharded clipping.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "core/comm/hybrid_groups.h"
#include "tests/support/local_ranks.h"
#include "core/ragged/planner.h"
#include "fsdp/fsdp_unit.h"
#include "fsdp/grad_clip.h"
#include "tests/cpp/test_util.h"

namespace rfsdp {
namespace {

using testing::fresh_seed;
using testing::seeded_randn;

// A random unit (identical on every rank: built from the shared seed).
std::vector<TensorSpec> random_unit(uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto U = [&](int64_t a, int64_t b) { return std::uniform_int_distribution<int64_t>(a, b)(rng); };
  std::vector<TensorSpec> unit;
  const int T = static_cast<int>(U(1, 6));
  for (int i = 0; i < T; ++i) {
    TensorSpec t;
    t.name = "p" + std::to_string(i);
    t.elem_bytes = 4;
    switch (U(0, 2)) {
      case 0: t.shape = {U(1, 40)}; break;
      case 1: t.shape = {U(1, 20), U(1, 9)}; break;
      default: t.shape = {U(1, 3), U(1, 5), U(1, 4)}; t.row_dims = static_cast<int>(U(1, 2));
    }
    const int64_t g = U(0, 3);
    t.granule_rows = g == 0 ? kWholeTensor : g;
    unit.push_back(t);
  }
  return unit;
}

// Two matrices of row lengths 7 and 9 (1-row granules) and a bias: on 4 ranks
// one buffer needs S = 288 elements, several buffers (collectives priced at 0)
// reach the size bound, 260 (rfsdp-plan --collective-cost-bytes 0 shows both).
std::vector<TensorSpec> two_class_unit() {
  std::vector<TensorSpec> unit;
  for (auto [name, shape] : {std::pair<const char*, std::vector<int64_t>>{"a", {64, 7}},
                             {"bias", {9}}, {"b", {64, 9}}}) {
    TensorSpec t;
    t.name = name;
    t.shape = shape;
    t.granule_rows = 1;
    unit.push_back(t);
  }
  return unit;
}

Plan plan_several(const std::vector<TensorSpec>& unit, int64_t world) {
  PlannerOptions free_collectives;
  free_collectives.collective_cost_bytes = 0;
  return plan_unit(unit, world, 16, free_collectives);
}

std::vector<at::Tensor> full_values(const Plan& plan, uint64_t seed, uint64_t stream) {
  std::vector<at::Tensor> v;
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    v.push_back(seeded_randn(plan.tensors[i].shape, seed, stream * 100 + i));
  }
  return v;
}

// The float64 gradient of tensor i that two accumulated passes reduce to: rank r's
// pass-p gradient is full_values(plan, seed, 1 + 10 p + r), rounded to the reduce
// dtype as the rank puts it in; summed over `world` ranks (Avg: the mean).
at::Tensor summed_reference(const Plan& plan, uint64_t seed, size_t i, int world,
                            at::ScalarType rdt, ReduceOp op) {
  at::Tensor ref = at::zeros(plan.tensors[i].shape, at::kDouble);
  for (int pass = 0; pass < 2; ++pass) {
    for (int r = 0; r < world; ++r) {
      ref += full_values(plan, seed, 1 + pass * 10 + r)[i].to(rdt).to(at::kDouble);
    }
  }
  if (op == ReduceOp::Avg) ref /= world;
  return ref;
}

// Rows [row_begin, row_end) of a full tensor, shaped like FSDPUnit::local_param.
at::Tensor rows_of(const at::Tensor& full, const TensorSpec& t, const ShardRange& r) {
  std::vector<int64_t> shape{r.row_end - r.row_begin};
  shape.insert(shape.end(), t.shape.begin() + t.row_dims, t.shape.end());
  return full.reshape(-1).narrow(0, r.row_begin * t.row_elems(), r.numel).view(shape);
}

class UnitWorld : public ::testing::TestWithParam<int> {};

TEST_P(UnitWorld, UnshardGivesEveryRankTheExactParameters) {
  const int world = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (int rep = 0; rep < 4; ++rep) {
    // Odd reps: several buffers (one gather each), when the planner finds them better.
    const Plan plan = rep % 2 ? plan_several(two_class_unit(), world)
                              : plan_unit(random_unit(seed + rep), world, 16);
    if (rep % 2 && world == 4) ASSERT_GT(plan.num_buffers(), 1u);
    for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
      run_local_ranks(world, [&](Comm& c) {
        auto comm = std::shared_ptr<Comm>(&c, [](Comm*) {});
        FSDPUnit unit(comm, plan, MixedPrecision{dt, at::kFloat});
        const auto full = full_values(plan, seed + rep, 0);
        unit.shard(full);
        for (size_t i = 0; i < full.size(); ++i) {
          ASSERT_TRUE(at::equal(unit.local_param(i), rows_of(full[i], plan.tensors[i],
                                                             unit.shard_range(i))));
        }
        for (int round = 0; round < 2; ++round) {  // views stay valid across reshard
          unit.unshard().wait();
          ASSERT_TRUE(unit.unsharded());
          for (size_t i = 0; i < full.size(); ++i) {
            ASSERT_TRUE(at::equal(unit.full_param(i), full[i].to(dt)))
                << "tensor " << i << " rank " << c.rank() << " round " << round;
          }
          unit.reshard();
          ASSERT_FALSE(unit.unsharded());
        }
      });
    }
  }
}

TEST_P(UnitWorld, ReduceGradsGivesEachRankItsSliceOfTheSum) {
  const int world = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const Plan& plan : {plan_unit(random_unit(seed), world, 16),
                           plan_several(two_class_unit(), world)})
  for (at::ScalarType rdt : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) {
      run_local_ranks(world, [&](Comm& c) {
        auto comm = std::shared_ptr<Comm>(&c, [](Comm*) {});
        FSDPUnit unit(comm, plan, MixedPrecision{at::kFloat, rdt});
        unit.shard(full_values(plan, seed, 0));
        // Two accumulated backward passes, each with per-rank gradients.
        for (int pass = 0; pass < 2; ++pass) {
          unit.prepare_grads();
          const auto g = full_values(plan, seed, 1 + pass * 10 + c.rank());
          for (size_t i = 0; i < g.size(); ++i) unit.full_grad(i).copy_(g[i]);
          unit.reduce_grads(op).wait();
        }
        for (size_t i = 0; i < plan.tensors.size(); ++i) {
          const at::Tensor ref = summed_reference(plan, seed, i, world, rdt, op);
          const at::Tensor want = rows_of(ref, plan.tensors[i], unit.shard_range(i));
          // fp16: 11 mantissa bits; bf16: 8 (the sum of 2 x world terms rounded in the
          // reduce dtype: its rounding grows with the terms)
          const double grow = std::max(1.0, world / 4.0);
          const double tol = (rdt == at::kFloat ? 1e-5 : rdt == at::kHalf ? 0.02 : 0.1) * grow;
          ASSERT_TRUE(at::allclose(unit.local_grad(i).to(at::kDouble), want, tol, tol))
              << "tensor " << i << " rank " << c.rank();
        }
      });
    }
  }
}

// Gradient sync off (rfsdp's set_requires_gradient_sync(False)): two backward
// passes add into the kept global gradient buffer, one reduce-scatter of the
// sum follows; the same slices as reducing each pass.
TEST_P(UnitWorld, KeptGradientsReduceOnceToTheSum) {
  const int world = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Plan plan = plan_unit(random_unit(seed), world, 16);
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) {
    run_local_ranks(world, [&](Comm& c) {
      auto comm = std::shared_ptr<Comm>(&c, [](Comm*) {});
      FSDPUnit unit(comm, plan, MixedPrecision{});
      unit.shard(full_values(plan, seed, 0));
      ASSERT_FALSE(unit.grads_unsharded());
      for (int pass = 0; pass < 2; ++pass) {
        unit.prepare_grads(/*keep=*/true);  // zeroed on the first pass only
        ASSERT_TRUE(unit.grads_unsharded());
        const auto g = full_values(plan, seed, 1 + pass * 10 + c.rank());
        for (size_t i = 0; i < g.size(); ++i) unit.full_grad(i).add_(g[i]);
      }
      unit.reduce_grads(op).wait();
      ASSERT_FALSE(unit.grads_unsharded());
      for (size_t i = 0; i < plan.tensors.size(); ++i) {
        const at::Tensor ref = summed_reference(plan, seed, i, world, at::kFloat, op);
        const at::Tensor want = rows_of(ref, plan.tensors[i], unit.shard_range(i));
        ASSERT_TRUE(at::allclose(unit.local_grad(i).to(at::kDouble), want, 1e-5, 1e-5))
            << "tensor " << i << " rank " << c.rank();
      }
    });
  }
}

// A 2-layer MLP whose parameters live in one unit; SGD on the local shards.
struct MlpShapes {
  static constexpr int64_t in = 7, hidden = 13, out = 5, batch = 96;  // (every world of the tests divides it)
};

std::vector<TensorSpec> mlp_unit(int64_t granule_w1) {
  auto spec = [](std::string n, std::vector<int64_t> s, int64_t g) {
    TensorSpec t;
    t.name = std::move(n);
    t.shape = std::move(s);
    t.granule_rows = g;
    return t;
  };
  return {spec("w1", {MlpShapes::hidden, MlpShapes::in}, granule_w1),
          spec("b1", {MlpShapes::hidden}, 1),
          spec("w2", {MlpShapes::out, MlpShapes::hidden}, kWholeTensor),
          spec("b2", {MlpShapes::out}, 1)};
}

at::Tensor mlp_loss(const std::vector<at::Tensor>& p, const at::Tensor& x, const at::Tensor& y) {
  at::Tensor h = at::relu(at::matmul(x, p[0].t()) + p[1]);
  return (at::matmul(h, p[2].t()) + p[3] - y).pow(2).mean();
}

constexpr int kMlpSteps = 5;
constexpr double kMlpLr = 0.1;

// One device, float64, the whole batch: kMlpSteps of SGD on the MLP.
std::vector<at::Tensor> mlp_reference(const Plan& plan, uint64_t seed) {
  const at::Tensor x = seeded_randn({MlpShapes::batch, MlpShapes::in}, seed, 500);
  const at::Tensor y = seeded_randn({MlpShapes::batch, MlpShapes::out}, seed, 501);
  std::vector<at::Tensor> ref;
  for (const auto& v : full_values(plan, seed, 0)) ref.push_back(v.to(at::kDouble));
  for (int s = 0; s < kMlpSteps; ++s) {
    std::vector<at::Tensor> p;
    for (auto& r : ref) p.push_back(r.detach().requires_grad_(true));
    mlp_loss(p, x.to(at::kDouble), y.to(at::kDouble)).backward();
    for (size_t i = 0; i < ref.size(); ++i) ref[i] = ref[i] - kMlpLr * p[i].grad();
  }
  return ref;
}

// The same steps on a sharded unit, this rank (of `ranks`, all data-parallel
// ranks) taking its slice of the batch; then its rows against the reference.
void train_mlp_and_compare(FSDPUnit& unit, uint64_t seed, int rank, int ranks,
                           const std::vector<at::Tensor>& ref) {
  const Plan& plan = unit.plan();
  unit.shard(full_values(plan, seed, 0));
  const int64_t per = MlpShapes::batch / ranks;
  const at::Tensor xs = seeded_randn({MlpShapes::batch, MlpShapes::in}, seed, 500)
                            .narrow(0, rank * per, per);
  const at::Tensor ys = seeded_randn({MlpShapes::batch, MlpShapes::out}, seed, 501)
                            .narrow(0, rank * per, per);
  for (int s = 0; s < kMlpSteps; ++s) {
    unit.unshard().wait();
    unit.prepare_grads();
    std::vector<at::Tensor> p;
    for (size_t i = 0; i < unit.num_params(); ++i) {
      // A leaf sharing the gathered storage, whose .grad is the gradient view.
      at::Tensor leaf = unit.full_param(i).detach().requires_grad_(true);
      leaf.mutable_grad() = unit.full_grad(i);
      p.push_back(leaf);
    }
    mlp_loss(p, xs, ys).backward();
    for (size_t i = 0; i < p.size(); ++i) {
      ASSERT_EQ(p[i].grad().data_ptr(), unit.full_grad(i).data_ptr()) << "grad did not land";
    }
    unit.reduce_grads(ReduceOp::Avg).wait();
    unit.local_param_slice().sub_(kMlpLr * unit.local_grad_slice());
    unit.zero_grad();
    unit.reshard();
  }
  for (size_t i = 0; i < unit.num_params(); ++i) {
    const at::Tensor want = rows_of(ref[i], plan.tensors[i], unit.shard_range(i));
    ASSERT_TRUE(at::allclose(unit.local_param(i).to(at::kDouble), want, 1e-5, 1e-5))
        << plan.tensors[i].name << " rank " << rank << " max err "
        << (unit.local_param(i).to(at::kDouble) - want).abs().max().item<double>();
  }
}

TEST_P(UnitWorld, TrainingStepsEqualOneRankWithTheWholeBatch) {
  const int world = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Plan plan = plan_unit(mlp_unit(1 + static_cast<int64_t>(seed % 3)), world, 16);
  const auto ref = mlp_reference(plan, seed);
  run_local_ranks(world, [&](Comm& c) {
    auto comm = std::shared_ptr<Comm>(&c, [](Comm*) {});
    FSDPUnit unit(comm, plan);
    train_mlp_and_compare(unit, seed, c.rank(), world, ref);
  });
}

TEST_P(UnitWorld, ShardedClippingEqualsTheSingleRankComputation) {
  const int world = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Plan pa = plan_unit(random_unit(seed), world, 16);
  const Plan pb = plan_unit(random_unit(seed + 1), world, 16);
  // Reference: the norm of the summed full gradients of both units, in float64.
  double sq = 0;
  std::vector<at::Tensor> sum_a, sum_b;
  for (const Plan* p : {&pa, &pb}) {
    auto& sums = p == &pa ? sum_a : sum_b;
    for (size_t i = 0; i < p->tensors.size(); ++i) {
      at::Tensor s = at::zeros(p->tensors[i].shape, at::kDouble);
      for (int r = 0; r < world; ++r) {
        s += full_values(*p, seed + (p == &pb), 1 + r)[i].to(at::kDouble);
      }
      sq += s.pow(2).sum().item<double>();
      sums.push_back(s);
    }
  }
  const double ref_norm = std::sqrt(sq), max_norm = 0.5 * ref_norm;
  const double coef = max_norm / (ref_norm + 1e-6);
  run_local_ranks(world, [&](Comm& c) {
    auto comm = std::shared_ptr<Comm>(&c, [](Comm*) {});
    FSDPUnit a(comm, pa), b(comm, pb);
    for (FSDPUnit* u : {&a, &b}) {
      const Plan& p = u->plan();
      u->shard(full_values(p, 0, 0));
      u->prepare_grads();
      const auto g = full_values(p, seed + (u == &b), 1 + c.rank());
      for (size_t i = 0; i < g.size(); ++i) u->full_grad(i).copy_(g[i]);
      u->reduce_grads(ReduceOp::Sum).wait();
    }
    const double norm = clip_grad_norm({&a, &b}, max_norm);
    ASSERT_NEAR(norm, ref_norm, 1e-5 * ref_norm);
    for (FSDPUnit* u : {&a, &b}) {
      const auto& sums = u == &a ? sum_a : sum_b;
      for (size_t i = 0; i < u->num_params(); ++i) {
        const at::Tensor want = rows_of(sums[i] * coef, u->plan().tensors[i], u->shard_range(i));
        ASSERT_TRUE(at::allclose(u->local_grad(i).to(at::kDouble), want, 1e-5, 1e-5));
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, UnitWorld, ::testing::Values(1, 2, 3, 4, 8, 16, 32));

// HSDP on w ranks as (w / m) replicas x m shards (m = 1: plain replication; m = w:
// plain FSDP): each rank's local gradients are its rows of the sum (or mean)
// over all w ranks, with accumulation; the clipping norm, reduced over the
// shard group alone, is the norm of that sum; SGD steps equal one device's.
class HsdpMesh : public ::testing::TestWithParam<std::pair<int, int>> {};  // (world, shard size)

TEST_P(HsdpMesh, GradientsNormsAndStepsCoverEveryRank) {
  const int world_size = GetParam().first;
  const int m = GetParam().second;
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Plan plan = plan_several(two_class_unit(), m);
  if (m == 4) ASSERT_GT(plan.num_buffers(), 1u);
  for (at::ScalarType rdt : {at::kFloat, at::kBFloat16}) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) {
      run_local_ranks(world_size, [&](Comm& world) {
        HybridGroups g = hybrid_groups(world, m);
        FSDPUnit unit(g.shard, g.replicate, plan, MixedPrecision{at::kFloat, rdt});
        ASSERT_EQ(unit.data_parallel_size(), world_size);
        unit.shard(full_values(plan, seed, 0));
        for (int pass = 0; pass < 2; ++pass) {
          unit.prepare_grads();
          const auto grads = full_values(plan, seed, 1 + pass * 10 + world.rank());
          for (size_t i = 0; i < grads.size(); ++i) unit.full_grad(i).copy_(grads[i]);
          unit.reduce_grads(op).wait();
        }
        double sq = 0;
        std::vector<at::Tensor> want(plan.tensors.size());
        for (size_t i = 0; i < plan.tensors.size(); ++i) {
          const at::Tensor ref = summed_reference(plan, seed, i, world_size, rdt, op);
          sq += ref.pow(2).sum().item<double>();
          want[i] = rows_of(ref, plan.tensors[i], unit.shard_range(i));
          const double tol = rdt == at::kFloat ? 1e-5 : 0.1;
          ASSERT_TRUE(at::allclose(unit.local_grad(i).to(at::kDouble), want[i], tol, tol))
              << "tensor " << i << " rank " << world.rank();
        }
        if (rdt != at::kFloat) return;
        const double ref_norm = std::sqrt(sq);
        const double norm = clip_grad_norm({&unit}, 0.5 * ref_norm);
        ASSERT_NEAR(norm, ref_norm, 1e-5 * ref_norm);
        for (size_t i = 0; i < plan.tensors.size(); ++i) {
          ASSERT_TRUE(at::allclose(unit.local_grad(i).to(at::kDouble),
                                   want[i] * (0.5 * ref_norm / (ref_norm + 1e-6)), 1e-5, 1e-5));
        }
      });
    }
  }
  // Training: each rank takes its share of the batch.
  const Plan mlp = plan_unit(mlp_unit(1 + static_cast<int64_t>(seed % 3)), m, 16);
  const auto ref = mlp_reference(mlp, seed);
  run_local_ranks(world_size, [&](Comm& world) {
    HybridGroups g = hybrid_groups(world, m);
    FSDPUnit unit(g.shard, g.replicate, mlp);
    train_mlp_and_compare(unit, seed, world.rank(), world_size, ref);
  });
}

// 4 ranks as 4 x 1, 2 x 2 and 1 x 4 (plain FSDP); 16 ranks as 4 x 4 and 2 x 8.
INSTANTIATE_TEST_SUITE_P(Meshes, HsdpMesh,
                         ::testing::Values(std::make_pair(4, 1), std::make_pair(4, 2),
                                           std::make_pair(4, 4), std::make_pair(16, 4),
                                           std::make_pair(16, 8)));

// Groups that do not make a mesh: the whole world as the "replica" group of a
// 2-rank shard group (its members hold different shards) is refused on every rank.
TEST(FSDPUnit, ReplicasThatHoldDifferentShardsAreRefused) {
  const Plan plan = plan_unit(mlp_unit(1), 2, 16);
  const auto errors = run_local_ranks_collect(4, [&](Comm& world) {
    HybridGroups g = hybrid_groups(world, 2);
    auto everyone = std::shared_ptr<Comm>(&world, [](Comm*) {});
    FSDPUnit unit(g.shard, everyone, plan);
  });
  for (const auto& e : errors) {
    ASSERT_TRUE(e);
    try {
      std::rethrow_exception(e);
    } catch (const std::invalid_argument& x) {
      EXPECT_NE(std::string(x.what()).find("different shard ranks"), std::string::npos) << x.what();
    }
  }
}

TEST(FSDPUnit, RanksThatBuildDifferentUnitsFailTogetherBeforeAnyOtherCollective) {
  // Rank 1 plans a Linear(24, 25) where rank 0 plans a Linear(24, 24): their
  // gathers would have different sizes (Gloo aborts the process there). Both
  // ranks refuse at construction, naming the tensor, the shapes and the ranks.
  const auto errors = run_local_ranks_collect(2, [&](Comm& comm) {
    TensorSpec w;
    w.name = "weight";
    w.shape = {comm.rank() == 1 ? 25 : 24, 24};
    const Plan plan = plan_unit({w}, 2, 16);
    FSDPUnit unit(std::shared_ptr<Comm>(&comm, [](Comm*) {}), plan);
  });
  for (const auto& e : errors) {
    ASSERT_TRUE(e) << "a rank built the unit";
    try {
      std::rethrow_exception(e);
    } catch (const std::invalid_argument& x) {
      const std::string m = x.what();
      EXPECT_NE(m.find("rank 0 has 'tensor 'weight' shape [24, 24]"), std::string::npos) << m;
      EXPECT_NE(m.find("rank 1 has 'tensor 'weight' shape [25, 24]"), std::string::npos) << m;
    }
  }
}

TEST(FSDPUnit, NonFiniteGradientsFailClearlyAndLeaveGradsAlone) {
  const Plan plan = plan_unit(mlp_unit(1), 2, 16);
  run_local_ranks(2, [&](Comm& c) {
    auto comm = std::shared_ptr<Comm>(&c, [](Comm*) {});
    FSDPUnit unit(comm, plan);
    unit.shard(full_values(plan, 1, 0));
    unit.prepare_grads();
    unit.full_grad(0).fill_(1.0);
    if (c.rank() == 1) unit.full_grad(0)[0][0] = std::nan("");
    unit.reduce_grads(ReduceOp::Sum).wait();
    const at::Tensor before = unit.local_grad_slice().clone();
    try {
      clip_grad_norm({&unit}, 1.0);
      ADD_FAILURE() << "no error on rank " << c.rank();
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("NaN or Inf"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(at::equal(before.isnan(), unit.local_grad_slice().isnan()));
    EXPECT_TRUE(at::equal(at::nan_to_num(before), at::nan_to_num(unit.local_grad_slice())));
  });
}

TEST(FSDPUnit, CopiesOnlyWhatTheCollectivesNeed) {
  const Plan plan = plan_unit(mlp_unit(1), 2, 16);
  for (FlatAlgorithm algo : {FlatAlgorithm::Native, FlatAlgorithm::PerRank}) {
    run_local_ranks(2, [&](Comm& c) {
      auto comm = std::shared_ptr<Comm>(&c, [](Comm*) {});
      c.set_flat_algorithms(algo, algo);
      FSDPUnit unit(comm, plan);
      unit.shard(full_values(plan, 1, 0));
      c.reset_stats();
      unit.unshard().wait();
      unit.prepare_grads();
      unit.reduce_grads().wait();
      const CommStats st = c.stats();
      const int64_t S = plan.shard_elems;
      if (algo == FlatAlgorithm::PerRank) {
        // The gather runs in place on the unit's buffer (its local slice is copied
        // in: S floats); the reduce-scatter's result is copied out (S floats).
        EXPECT_EQ(st.gathers_per_rank, 1);
        EXPECT_EQ(st.reduce_scatters_per_rank, 1);
        EXPECT_EQ(st.bytes_copied, 2 * S * 4);
      } else {
        // Gloo's own staging only: (m + 1) * S floats for each collective.
        EXPECT_EQ(st.gathers_native, 1);
        EXPECT_EQ(st.reduce_scatters_native, 1);
        EXPECT_EQ(st.bytes_copied, 2 * 3 * S * 4);
      }
      EXPECT_EQ(unit.bytes_cast(), 0);  // fp32 throughout: no cast
    });
  }
}

TEST(FSDPUnit, MisuseGetsClearErrors) {
  const Plan plan2 = plan_unit(mlp_unit(1), 2, 16);
  run_local_ranks(1, [&](Comm& c) {
    auto comm = std::shared_ptr<Comm>(&c, [](Comm*) {});
    EXPECT_THROW(FSDPUnit(comm, plan2), std::invalid_argument);  // world size mismatch
    const Plan plan1 = plan_unit(mlp_unit(1), 1, 16);
    FSDPUnit unit(comm, plan1);
    auto full = full_values(plan1, 1, 0);
    full[2] = at::zeros({3, 3});
    EXPECT_THROW(unit.shard(full), std::invalid_argument);
    EXPECT_THROW(unit.reduce_grads(), std::logic_error);  // no prepare_grads
    CommHandle h = unit.unshard();
    EXPECT_THROW(unit.reshard(), std::logic_error);  // gather not waited
    h.wait();
    EXPECT_NO_THROW(unit.reshard());
  });
}

}  // namespace
}  // namespace rfsdp
