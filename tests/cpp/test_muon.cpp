// Distributed Muon on 1-4 ranks (threads) against a float64 single-device Muon
// written here on the full matrices; root selection; errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <random>

#include "tests/support/local_ranks.h"
#include "optimizers/muon/muon.h"
#include "tests/cpp/column_parts_test_util.h"
#include "tests/cpp/test_util.h"
#include "quant/ops.h"
#include "optimizers/common/param_shard.h"

namespace rfsdp {
namespace {

using testing::CodeCheck;
using testing::expect_block_codes;
using testing::ColumnPartsMatrix;
using testing::fresh_seed;
using testing::seeded_randn;

struct Shape {
  std::string name;
  std::vector<int64_t> shape;
  int row_dims;
};

// rows > cols, rows < cols, fewer rows than ranks, an expert stack whose rows
// (experts x hidden) are cut anywhere, a matrix forced across three ranks, and
// a twin of "tall" (equal shapes on one root: batched Newton–Schulz).
const std::vector<Shape> kShapes = {{"tall", {37, 11}, 1},   {"wide", {9, 30}, 1},
                                    {"few_rows", {2, 17}, 1}, {"experts", {3, 8, 6}, 2},
                                    {"split3", {48, 5}, 1},   {"tall_twin", {37, 11}, 1}};

int64_t rows_of(const Shape& s) {
  int64_t r = 1;
  for (int d = 0; d < s.row_dims; ++d) r *= s.shape[d];
  return r;
}

int64_t numel_of(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s.shape) n *= d;
  return n;
}

// Row cut points per tensor: rank r holds rows [cuts[r], cuts[r+1]). Random, or
// (whole) each tensor on one rank.
std::vector<std::vector<int64_t>> make_cuts(int world, uint64_t seed, bool whole) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int64_t>> cuts;
  for (size_t t = 0; t < kShapes.size(); ++t) {
    const int64_t rows = rows_of(kShapes[t]);
    std::vector<int64_t> c(world + 1, 0);
    if (whole) {
      const int owner = static_cast<int>(t % world);
      for (int r = owner + 1; r <= world; ++r) c[r] = rows;
    } else if (kShapes[t].name == "split3" && world >= 3) {
      // Three pieces on three consecutive ranks, starting at a random one.
      const int first = static_cast<int>(rng() % (world - 2));
      for (int r = first + 1; r <= world; ++r) c[r] = rows;
      c[first + 1] = rows / 3, c[first + 2] = 2 * rows / 3;
    } else {
      for (int r = 1; r < world; ++r) c[r] = static_cast<int64_t>(rng() % (rows + 1));
      std::sort(c.begin() + 1, c.end() - 1);
      c[world] = rows;
    }
    cuts.push_back(c);
  }
  return cuts;
}

// --- the float64 reference ---------------------------------------------------
at::Tensor ref_orthogonalise(at::Tensor g, int steps) {
  const bool tall = g.size(0) > g.size(1);
  at::Tensor x = tall ? g.t() : g;
  x = x / (std::sqrt((x * x).sum().item<double>()) + 1e-7);
  for (int i = 0; i < steps; ++i) {
    at::Tensor a = at::matmul(x, x.t());
    at::Tensor b = -4.7750 * a + 2.0315 * at::matmul(a, a);
    x = 3.4445 * x + at::matmul(b, x);
  }
  return tall ? x.t() : x;
}

void ref_step(at::Tensor& w, at::Tensor& m, const at::Tensor& g, const MuonOptions& h) {
  m = h.momentum * m + (1 - h.momentum) * g;
  at::Tensor u = h.nesterov ? (1 - h.momentum) * g + h.momentum * m : m;
  std::vector<at::Tensor> mats;  // views of u and w, one per matrix
  std::vector<at::Tensor> wmats;
  if (u.dim() == 3) {
    for (int64_t e = 0; e < u.size(0); ++e) mats.push_back(u[e]), wmats.push_back(w[e]);
  } else {
    mats.push_back(u.reshape({u.size(0), -1}));
    wmats.push_back(w.view({w.size(0), -1}));
  }
  for (size_t i = 0; i < mats.size(); ++i) {
    const double r = mats[i].size(0), c = mats[i].size(1);
    const double scale = h.adjust_lr == MuonAdjustLr::Original ? std::sqrt(std::max(1.0, r / c))
                                                                : 0.2 * std::sqrt(std::max(r, c));
    at::Tensor o = ref_orthogonalise(mats[i], 5) * scale;
    wmats[i].mul_(1 - h.lr * h.weight_decay).sub_(h.lr * o);
  }
}

at::Tensor rows_view(const at::Tensor& full, const Shape& s) {
  return full.reshape({rows_of(s), numel_of(s) / rows_of(s)});
}

struct Config {
  int world;
  bool whole;
  MuonOptions options;
  bool batch = false;  // batched Newton–Schulz for equal shapes on a root
  // Every other tensor replicated (each rank holds it whole, equal gradients: DDP),
  // the rest cut as `whole` says.
  bool replicated = false;
};

void run_against_reference(const Config& cfg) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + ", world " + std::to_string(cfg.world));
  constexpr int kSteps = 20;
  const auto cuts = make_cuts(cfg.world, seed, cfg.whole);
  std::vector<at::Tensor> init;
  for (size_t t = 0; t < kShapes.size(); ++t) init.push_back(seeded_randn(kShapes[t].shape, seed, t, at::kDouble));
  auto grad_at = [&](int step, size_t t) {
    return seeded_randn(kShapes[t].shape, seed, 1000 + step * 100 + t, at::kDouble);
  };
  // Reference.
  std::vector<at::Tensor> w, m;
  for (size_t t = 0; t < kShapes.size(); ++t) {
    w.push_back(init[t].clone());
    m.push_back(at::zeros_like(init[t]));
  }
  for (int step = 0; step < kSteps; ++step) {
    for (size_t t = 0; t < kShapes.size(); ++t) ref_step(w[t], m[t], grad_at(step, t), cfg.options);
  }
  std::mutex mu;
  std::map<int, std::string> failures;
  auto replicated = [&](size_t t) { return cfg.replicated && t % 2 == 0; };
  run_local_ranks(cfg.world, [&](Comm& comm) {
    const int r = comm.rank();
    std::vector<ParamShard> shards;
    for (size_t t = 0; t < kShapes.size(); ++t) {
      const Shape& s = kShapes[t];
      if (replicated(t)) {
        shards.emplace_back(TensorShard::whole(s.name, s.shape, s.row_dims),
                            rows_view(init[t], s).to(at::kFloat).contiguous());
        shards.back().grad = at::zeros_like(shards.back().param);
        continue;
      }
      // Every rank's rows known (as fully_shard's are) on odd worlds; gathered by
      // the layout (one all-reduce) on even ones: both paths see every case.
      std::vector<std::pair<int64_t, int64_t>> every;
      if (cfg.world % 2 == 1) {
        for (int q = 0; q < cfg.world; ++q) every.emplace_back(cuts[t][q], cuts[t][q + 1]);
      }
      const int64_t n = cuts[t][r + 1] - cuts[t][r];
      ParamShard p(TensorShard::rows_of(s.name, s.shape, s.row_dims, cuts[t][r], cuts[t][r + 1], every),
                   rows_view(init[t], s).narrow(0, cuts[t][r], n).to(at::kFloat).contiguous());
      ASSERT_EQ(p.full_rows, rows_of(s));
      p.grad = at::zeros_like(p.param);
      shards.push_back(p);
    }
    MuonConfig config;
    config.batch_newton_schulz = cfg.batch;
    Muon muon(shards, cfg.options, config, std::shared_ptr<Comm>(&comm, [](Comm*) {}));
    if (cfg.whole) EXPECT_EQ(muon.layout().gather_send_elems(), 0);
    if (cfg.replicated && cfg.world > 1) {
      // a replicated matrix: nothing gathered; its root sends it whole to the others
      int64_t rooted_elsewhere = 0;
      for (size_t k = 0; k < muon.layout().matrices().size(); ++k) {
        const MuonMatrix& m = muon.layout().matrices()[k];
        EXPECT_EQ(m.replicated, replicated(m.param));
        if (!m.replicated) continue;
        if (m.root != r) rooted_elsewhere += m.rows * m.cols;
        const auto gp = muon.layout().gather_piece(k, r);
        EXPECT_EQ(gp.second - gp.first, m.root == r ? m.rows * m.cols : 0);
      }
      EXPECT_EQ(muon.layout().scatter_recv_elems() - rooted_elsewhere,
                muon.layout().gather_send_elems()) << "receives the others' replicated matrices whole";
    }
    for (int step = 0; step < kSteps; ++step) {
      for (size_t t = 0; t < kShapes.size(); ++t) {
        const int64_t n = shards[t].rows();
        shards[t].grad.copy_(rows_view(grad_at(step, t), kShapes[t]).narrow(0, shards[t].row_begin, n)
                                 .reshape(shards[t].grad.sizes()));
      }
      muon.step();
    }
    for (size_t t = 0; t < kShapes.size(); ++t) {
      const int64_t n = shards[t].rows();
      const at::Tensor want = rows_view(w[t], kShapes[t]).narrow(0, shards[t].row_begin, n);
      const at::Tensor got = shards[t].param.to(at::kDouble).reshape(want.sizes());
      const double err = n ? (got - want).abs().max().item<double>() : 0.0;
      const double tol = 2e-5 * (1 + (n ? want.abs().max().item<double>() : 0.0));
      if (!(err <= tol)) {
        std::lock_guard<std::mutex> lock(mu);
        failures[r] += kShapes[t].name + ": max error " + std::to_string(err) + "; ";
      }
    }
  });
  for (const auto& [r, msg] : failures) ADD_FAILURE() << "rank " << r << ": " << msg;
}

class MuonRanks : public ::testing::TestWithParam<int> {};

TEST_P(MuonRanks, RaggedShardsMatchSingleDeviceReference) {
  run_against_reference({GetParam(), false, MuonOptions{0.02, 0.95, 0.01, true, MuonAdjustLr::Original}});
}

TEST_P(MuonRanks, NoNesterovMatchRmsAdamWMatchesReference) {
  run_against_reference(
      {GetParam(), false, MuonOptions{0.01, 0.9, 0.1, false, MuonAdjustLr::MatchRmsAdamW}});
}

TEST_P(MuonRanks, WholeMatricesMoveNothingAndMatchReference) {
  run_against_reference({GetParam(), true, MuonOptions{0.02, 0.95, 0.0, true, MuonAdjustLr::Original}});
}

TEST_P(MuonRanks, BatchedNewtonSchulzMatchesReference) {
  run_against_reference(
      {GetParam(), false, MuonOptions{0.02, 0.95, 0.01, true, MuonAdjustLr::Original}, true});
  run_against_reference(
      {GetParam(), true, MuonOptions{0.02, 0.95, 0.01, true, MuonAdjustLr::Original}, true});
}

TEST_P(MuonRanks, ReplicatedTensorsStepAsOneDeviceOnEveryRank) {
  run_against_reference(
      {GetParam(), false, MuonOptions{0.02, 0.95, 0.01, true, MuonAdjustLr::Original}, false, true});
  run_against_reference(
      {GetParam(), true, MuonOptions{0.02, 0.95, 0.0, true, MuonAdjustLr::Original}, true, true});
}

INSTANTIATE_TEST_SUITE_P(Worlds, MuonRanks, ::testing::Values(1, 2, 3, 4, 8, 16, 32));

TEST(MuonLayout, EveryMatrixHasExactlyOneRootAgreedByAllRanks) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (int world : {2, 3, 4, 8, 16, 32}) {
    const auto cuts = make_cuts(world, seed + world, false);
    run_local_ranks(world, [&](Comm& comm) {
      std::vector<TensorShard> shards;
      for (size_t t = 0; t < kShapes.size(); ++t) {
        std::vector<std::pair<int64_t, int64_t>> every;
        for (int q = 0; q < world; ++q) every.emplace_back(cuts[t][q], cuts[t][q + 1]);
        shards.push_back(TensorShard::rows_of(kShapes[t].name, kShapes[t].shape, kShapes[t].row_dims,
                                              cuts[t][comm.rank()], cuts[t][comm.rank() + 1], every));
      }
      MuonLayout layout(&comm, shards, std::vector<int>(shards.size(), 5));
      const auto& mats = layout.matrices();
      ASSERT_EQ(mats.size(), 5u + 3u);  // tall, wide, few_rows, 3 experts, split3, tall_twin
      // Each rank marks the matrices it roots; the sum over ranks must be 1 each.
      at::Tensor mine = at::zeros({static_cast<int64_t>(mats.size())}, at::kFloat);
      for (size_t k = 0; k < mats.size(); ++k) {
        ASSERT_GE(mats[k].root, 0);
        ASSERT_LT(mats[k].root, world);
        if (mats[k].root == comm.rank()) mine[k] = 1.0f;
        int holders = 0, holder = -1;
        for (int r = 0; r < world; ++r) {
          const auto pc = layout.piece(k, r);
          if (pc.first < pc.second) ++holders, holder = r;
        }
        if (holders == 1) EXPECT_EQ(mats[k].root, holder) << "matrix " << k;
      }
      comm.all_reduce(mine, ReduceOp::Sum).wait();
      for (size_t k = 0; k < mats.size(); ++k) EXPECT_EQ(mine[k].item<float>(), 1.0f) << "matrix " << k;
      const auto f = layout.rank_flops();
      double total = 0;
      for (const auto& m : mats) total += m.flops;
      EXPECT_NEAR(std::accumulate(f.begin(), f.end(), 0.0), total, 1e-6 * total);
      // Each rank's flops are those of the matrices rooted there, and the imbalance
      // is the largest over the mean of them, recomputed here from the roots.
      std::vector<double> mine_flops(world, 0.0);
      for (const auto& m : mats) mine_flops[m.root] += m.flops;
      for (int r = 0; r < world; ++r) EXPECT_NEAR(f[r], mine_flops[r], 1e-9 * total) << "rank " << r;
      const double max_f = *std::max_element(mine_flops.begin(), mine_flops.end());
      EXPECT_NEAR(layout.flop_imbalance(), max_f / (total / world), 1e-9);
    });
  }
}

// split_sizes: every block of rows its own matrix (a 3-D stack: of each expert),
// blocks held whole by one rank rooted there and sending nothing, cut ones
// gathered; a split that does not sum to the rows is an error naming the tensor.
TEST(MuonLayout, SplitBlocksAreMatricesOfTheirOwnRootedWhereTheyLie) {
  run_local_ranks(2, [](Comm& comm) {
    // w [12, 4] split 4 + 8, rows 0..4 | 4..12: both blocks whole (nothing sent);
    // e [2, 6, 3] split 2 + 4 per expert, rows (experts) 0..1 | 1..2.
    const std::vector<std::pair<int64_t, int64_t>> w_rows = {{0, 4}, {4, 12}}, e_rows = {{0, 1}, {1, 2}};
    const int r = comm.rank();
    std::vector<TensorShard> shards{
        TensorShard::rows_of("w", {12, 4}, 1, w_rows[r].first, w_rows[r].second, w_rows),
        TensorShard::rows_of("e", {2, 6, 3}, 1, e_rows[r].first, e_rows[r].second, e_rows)};
    MuonLayout layout(&comm, shards, {5, 5}, {{4, 8}, {2, 4}});
    const auto& m = layout.matrices();
    ASSERT_EQ(m.size(), 6u);
    const std::vector<std::array<int64_t, 4>> want = {  // param, offset, rows, cols
        {0, 0, 4, 4}, {0, 16, 8, 4}, {1, 0, 2, 3}, {1, 6, 4, 3}, {1, 18, 2, 3}, {1, 24, 4, 3}};
    const std::vector<int> roots = {0, 1, 0, 0, 1, 1};
    for (size_t k = 0; k < m.size(); ++k) {
      EXPECT_EQ((std::array<int64_t, 4>{int64_t(m[k].param), m[k].offset, m[k].rows, m[k].cols}), want[k]) << k;
      EXPECT_EQ(m[k].root, roots[k]) << k;
      EXPECT_DOUBLE_EQ(m[k].flops, newton_schulz_flops(want[k][2], want[k][3], 5)) << k;
    }
    EXPECT_EQ(layout.gather_send_elems(), 0);
    // Unsplit, w is one matrix cut between the ranks: one of them sends its rows.
    MuonLayout whole(&comm, shards, {5, 5});
    ASSERT_EQ(whole.matrices().size(), 3u);
    EXPECT_EQ(whole.gather_send_elems(), whole.matrices()[0].root == r ? 0 : (r == 0 ? 16 : 32));
  });
  try {
    MuonLayout(nullptr, {TensorShard::whole("w", {12, 4})}, {5}, {{4, 6}});
    ADD_FAILURE() << "a split of 10 rows of 12 was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'w'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("sum to 10 rows"), std::string::npos) << e.what();
  }
}

TEST(MuonLayout, SplitRowBlocksAreRootedOnARankHoldingThem) {
  // A head-major fused QKV [24, 8] split in 4-row blocks as ColwiseParallel (tp 2)
  // then FSDP2 (dp 2) leave it: ranks 0, 2 hold rows 0..12 (tp 0), ranks 1, 3
  // rows 12..24; blocks 4..8 and 16..20 are cut by dp alone. Two big matrices
  // held whole by ranks 0 and 2 load them, so the least-loaded rank for block
  // 4..8 would be one of the other tp rank's: it must still be a holder.
  run_local_ranks(4, [](Comm& comm) {
    const std::vector<std::pair<int64_t, int64_t>> qkv = {{0, 6}, {12, 18}, {6, 12}, {18, 24}};
    const std::vector<std::pair<int64_t, int64_t>> on0 = {{0, 64}, {64, 64}, {64, 64}, {64, 64}};
    const std::vector<std::pair<int64_t, int64_t>> on2 = {{0, 0}, {0, 0}, {0, 64}, {64, 64}};
    const int r = comm.rank();
    std::vector<TensorShard> shards{
        TensorShard::rows_of("qkv", {24, 8}, 1, qkv[r].first, qkv[r].second, qkv),
        TensorShard::rows_of("big0", {64, 64}, 1, on0[r].first, on0[r].second, on0),
        TensorShard::rows_of("big2", {64, 64}, 1, on2[r].first, on2[r].second, on2)};
    MuonLayout layout(&comm, shards, {5, 5, 5}, {std::vector<int64_t>(6, 4), {}, {}});
    for (size_t k = 0; k < layout.matrices().size(); ++k) {
      const MuonMatrix& m = layout.matrices()[k];
      const auto p = layout.piece(k, m.root);
      EXPECT_GT(p.second, p.first) << "matrix " << k << " of '" << shards[m.param].name
                                   << "' rooted on rank " << m.root << ", which holds none of it";
    }
  });
}

TEST(MuonLayout, BalancesEqualSharedMatricesAcrossRanks) {
  // Eight equal matrices each cut in half between ranks 0 and 1 of 4: LPT puts two on every rank.
  run_local_ranks(4, [](Comm& comm) {
    const std::vector<std::pair<int64_t, int64_t>> every = {{0, 4}, {4, 8}, {8, 8}, {8, 8}};
    std::vector<TensorShard> shards;
    for (int i = 0; i < 8; ++i) {
      const auto [b, e] = every[comm.rank()];
      shards.push_back(TensorShard::rows_of("w" + std::to_string(i), {8, 8}, 1, b, e, every));
    }
    MuonLayout layout(&comm, shards, std::vector<int>(8, 5));
    EXPECT_DOUBLE_EQ(layout.flop_imbalance(), 1.0);
  });
}

TEST(Muon, RefusesVectorsNamingThem) {
  ParamShard p = whole_param("ln.weight", at::zeros({7}), at::zeros({7}));
  try {
    Muon muon({p});
    FAIL() << "a 1-D parameter was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'ln.weight'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("AdamW"), std::string::npos) << e.what();
  }
}

// Every rank threw std::invalid_argument saying `what`.
void expect_every_rank_refused(const std::vector<std::exception_ptr>& errors, const std::string& what) {
  for (const auto& e : errors) {
    ASSERT_TRUE(e) << "a rank went on";
    try {
      std::rethrow_exception(e);
    } catch (const std::invalid_argument& x) {
      EXPECT_NE(std::string(x.what()).find(what), std::string::npos) << x.what();
    }
  }
}

TEST(Muon, RanksWithDifferentParametersFailClearly) {
  auto errors = run_local_ranks_collect(2, [](Comm& comm) {
    const int64_t cols = comm.rank() == 0 ? 6 : 5;
    MuonLayout layout(&comm, {TensorShard::rows_of("w", {4, cols}, 1, 2 * comm.rank(), 2 * comm.rank() + 2,
                                                   {{0, 2}, {2, 4}})}, {5});
  });
  expect_every_rank_refused(errors, "Muon's parameters");
  expect_every_rank_refused(errors, "[4, 6]");
}

// Shards that know every rank's rows (fully_shard's, from the plan) give the
// layout its ranges: the ranks only agree on a hash of them (one collective of
// 8 bytes a rank, not a table of every range), and a rank that differs is named on
// every rank.
TEST(Muon, RangesFromTheShardsNeedOnlyAnAgreedHash) {
  auto errors = run_local_ranks_collect(3, [](Comm& comm) {
    const std::vector<std::pair<int64_t, int64_t>> rows = {{0, 2}, {2, 5}, {5, 8}};
    const auto [b, e] = rows[comm.rank()];
    std::vector<ParamShard> shards;
    shards.emplace_back(TensorShard::rows_of("w", {8, 6}, 1, b, e, rows), at::zeros({e - b, 6}));
    shards.emplace_back(TensorShard::rows_of("v", {8, 6}, 1, b, e, rows), at::zeros({e - b, 6}));
    comm.reset_stats();
    Muon muon(shards, {}, {}, std::shared_ptr<Comm>(&comm, [](Comm*) {}));
    EXPECT_EQ(comm.stats().collectives, 1);
    EXPECT_EQ(comm.stats().bytes_sent, 3 * 8) << "one 64-bit hash per rank";
    // The layout equals the gathered one: every rank's pieces as the plan says.
    for (size_t k = 0; k < muon.layout().matrices().size(); ++k) {
      for (int r = 0; r < 3; ++r) {
        EXPECT_EQ(muon.layout().piece(k, r), std::make_pair(rows[r].first * 6, rows[r].second * 6));
      }
    }
    // Rank 2 builds Muon with other Newton-Schulz steps: every rank fails, naming it.
    std::vector<int> steps = {5, comm.rank() == 2 ? 3 : 5};
    Muon other(shards, {}, {}, std::shared_ptr<Comm>(&comm, [](Comm*) {}), steps);
  });
  expect_every_rank_refused(errors, "Muon's parameters");
  expect_every_rank_refused(errors, "ns_steps 3");
}

TEST(Muon, AMixOfWholeAndShardedRangesIsRefused) {
  auto errors = run_local_ranks_collect(3, [](Comm& comm) {
    // ranks 0 and 1 claim everything, rank 2 half: neither replicated nor a tiling
    const int64_t e = comm.rank() == 2 ? 2 : 4;
    MuonLayout layout(&comm, {TensorShard::rows_of("w", {4, 6}, 1, 0, e, {{0, 4}, {0, 4}, {0, 2}})}, {5});
  });
  expect_every_rank_refused(errors, "do not tile");
}

// One Muon step on 2 ranks over shard_of(rank) (ones, gradients of ones), with
// spoil(gradient) on rank 1 first: what each rank threw; a rank that threw kept
// its parameter and momentum.
std::vector<std::exception_ptr> step_with_rank1_spoiled(
    const std::function<ParamShard(int)>& shard_of, const std::function<void(at::Tensor&)>& spoil) {
  return run_local_ranks_collect(2, [&](Comm& comm) {
    ParamShard p = shard_of(comm.rank());
    const at::Tensor before = p.param.clone();
    if (comm.rank() == 1) spoil(p.grad);
    Muon muon({p}, {}, {}, std::shared_ptr<Comm>(&comm, [](Comm*) {}));
    try {
      muon.step();
    } catch (...) {
      EXPECT_TRUE(at::equal(p.param, before));
      EXPECT_TRUE(at::equal(muon.momentum(0), at::zeros_like(before)));
      throw;
    }
  });
}

TEST(Muon, ReplicatedGradientsThatDifferAreRefusedOnEveryRankBeforeAnyChange) {
  const auto errors = step_with_rank1_spoiled(
      [](int) { return ParamShard(TensorShard::whole("w", {6, 4}), at::ones({6, 4}), at::ones({6, 4})); },
      [](at::Tensor& g) { g[2][3] = 1.5f; });  // a rank whose gradient was not all-reduced
  expect_every_rank_refused(errors, "gradients differ between the ranks");
}

TEST(Muon, NanGradientOnOneRankStopsEveryRankBeforeAnyChange) {
  const auto errors = step_with_rank1_spoiled(
      [](int rank) {
        const int64_t b = rank * 3;
        return ParamShard(TensorShard::rows_of("w", {6, 4}, 1, b, b + 3, {{0, 3}, {3, 6}}),
                          at::ones({3, 4}), at::ones({3, 4}));
      },
      [](at::Tensor& g) { g[1][2] = std::nan(""); });
  for (const auto& e : errors) EXPECT_TRUE(e) << "a rank took the step";
}

class MuonGate : public ::testing::TestWithParam<int> {};

TEST_P(MuonGate, ARootFailureOnOneRanksMatrixStopsEveryRankAtOnceAndALaterStepWorks) {
  // Two 12 x 5 matrices cut by rows over the ranks, each rooted on its own rank.
  // With the NaN check off (as the Python wrapper runs it, having checked both of
  // its parts), a NaN in one rank's piece of "a" reaches a's root, whose
  // Newton–Schulz result is not finite: every rank raises that, naming the
  // matrix and its root, before any momentum or parameter changed.
  const int world = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mutex mu;
  std::vector<std::string> messages(world);
  std::vector<double> seconds(world);
  int root_of_a = -1;
  run_local_ranks(world, [&](Comm& comm) {
    const int64_t rows = 12, cols = 5;
    auto piece = [&](int r) {  // rows [b, e) of rank r
      return std::make_pair(rows * r / world, rows * (r + 1) / world);
    };
    const auto [b, e] = piece(comm.rank());
    std::vector<ParamShard> shards;
    for (const char* name : {"a", "b"}) {
      shards.emplace_back(TensorShard::rows_of(name, {rows, cols}, 1, b, e),
                          seeded_randn({rows, cols}, seed, name[0]).narrow(0, b, e - b).clone());
    }
    MuonConfig o;
    o.check_finite = false;
    Muon muon(shards, {}, o, std::shared_ptr<Comm>(&comm, [](Comm*) {}));
    const int root = muon.layout().matrices()[0].root;
    auto give = [&](int step, bool nan) {
      for (size_t i = 0; i < 2; ++i) {
        at::Tensor g = seeded_randn({rows, cols}, seed, 100 * step + i).narrow(0, b, e - b).clone();
        // the NaN lands in a piece another rank than the root holds, where there is one
        if (nan && i == 0 && comm.rank() == (root + 1) % world) g[0][0] = std::nan("");
        muon.set_grad(i, g);
      }
    };
    give(1, false);
    muon.step();
    give(2, true);
    std::vector<at::Tensor> before;
    for (size_t i = 0; i < 2; ++i) before.push_back(shards[i].param.clone()), before.push_back(muon.momentum(i).clone());
    const auto t0 = std::chrono::steady_clock::now();
    try {
      muon.step();
      ADD_FAILURE() << "rank " << comm.rank() << " took the step";
    } catch (const std::runtime_error& x) {
      std::lock_guard<std::mutex> lock(mu);
      messages[comm.rank()] = x.what();
      seconds[comm.rank()] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      root_of_a = root;
    }
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_TRUE(at::equal(shards[i].param, before[2 * i])) << "parameter " << i;
      EXPECT_TRUE(at::equal(muon.momentum(i), before[2 * i + 1])) << "momentum " << i;
    }
    EXPECT_EQ(muon.steps(), 1);
    give(3, false);  // the ranks step on together
    muon.step();
    EXPECT_EQ(muon.steps(), 2);
    EXPECT_FALSE(at::equal(muon.momentum(0), before[1]));
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(messages[r], messages[0]) << "rank " << r;
    EXPECT_LT(seconds[r], 20.0) << "rank " << r << " waited (the harness timeout is 60 s)";
  }
  const std::string& m = messages[0];
  EXPECT_NE(m.find("Muon step: the Newton-Schulz result of matrix 0 of 'a' (12 x 5) is not finite"),
            std::string::npos) << m;
  if (world > 1) {
    EXPECT_NE(m.find("(on rank " + std::to_string(root_of_a) + ")"), std::string::npos) << m;
    EXPECT_NE(m.find("not taken on any rank"), std::string::npos) << m;
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, MuonGate, ::testing::Values(1, 2, 3));

// --- low-bit momentum ------------------------------------------------------------
// 8-bit momentum (blocks of 64 elements of the global tensor) on shards cut at
// block edges: every step, codes and scales against float64 arithmetic of the
// same quantised algorithm (decode, lerp, max |m| per block, nearest code), the
// parameters against the float64 Muon step from the decoded momentum; and codes
// and scales bit for bit equal on 1, 2 and 4 ranks. bf16: the stored momentum is
// the bf16 rounding of the float64 lerp from the stored one (within one unit).
constexpr int64_t kBlock = 64;
const std::vector<Shape> kBlockShapes = {{"a", {24, 40}, 1}, {"b", {30, 16}, 1},
                                         {"experts", {3, 8, 12}, 2}};

struct LowBitRun {
  // Per step and tensor, full: decoded momentum and parameters before, parameters
  // after, codes and absmax after (8-bit).
  std::vector<std::vector<at::Tensor>> m_before, p_before, p_after, codes, absmax;
};

LowBitRun run_low_bit(int world, uint64_t seed, at::ScalarType dtype, int steps, const MuonOptions& h) {
  std::mt19937_64 rng(seed + world);
  std::vector<std::vector<int64_t>> cuts;  // at block edges
  for (const Shape& s : kBlockShapes) {
    const int64_t rows = rows_of(s), row_len = numel_of(s) / rows;
    const int64_t granule = kBlock / std::gcd(kBlock, row_len);
    std::vector<int64_t> c(world + 1, rows);
    c[0] = 0;
    for (int r = 1; r < world; ++r) c[r] = std::min(rows, static_cast<int64_t>(rng() % (rows / granule + 1)) * granule);
    std::sort(c.begin(), c.end());
    cuts.push_back(c);
  }
  LowBitRun run;
  auto full = [&](size_t t, at::ScalarType dt) { return at::zeros({numel_of(kBlockShapes[t])}, dt); };
  for (auto* v : {&run.m_before, &run.p_before, &run.p_after, &run.codes, &run.absmax}) v->resize(steps);
  for (int k = 0; k < steps; ++k) {
    for (size_t t = 0; t < kBlockShapes.size(); ++t) {
      run.m_before[k].push_back(full(t, at::kFloat));
      run.p_before[k].push_back(full(t, at::kFloat));
      run.p_after[k].push_back(full(t, at::kFloat));
      run.codes[k].push_back(full(t, at::kByte));
      run.absmax[k].push_back(at::zeros({(numel_of(kBlockShapes[t]) + kBlock - 1) / kBlock}));
    }
  }
  std::mutex mu;
  run_local_ranks(world, [&](Comm& comm) {
    const int r = comm.rank();
    std::vector<ParamShard> shards;
    for (size_t t = 0; t < kBlockShapes.size(); ++t) {
      const Shape& s = kBlockShapes[t];
      const at::Tensor init = seeded_randn(s.shape, seed, t);
      ParamShard p(TensorShard::rows_of(s.name, s.shape, s.row_dims, cuts[t][r], cuts[t][r + 1]),
                   rows_view(init, s).narrow(0, cuts[t][r], cuts[t][r + 1] - cuts[t][r]).contiguous());
      p.grad = at::zeros_like(p.param);
      shards.push_back(p);
    }
    MuonConfig o;
    o.momentum_dtype = dtype;
    o.momentum_block = kBlock;
    Muon muon(shards, h, o, std::shared_ptr<Comm>(&comm, [](Comm*) {}));
    for (int k = 0; k < steps; ++k) {
      auto put = [&](std::vector<at::Tensor>& dst, size_t t, const at::Tensor& x) {
        const int64_t e0 = shards[t].row_begin * shards[t].row_len;
        std::lock_guard<std::mutex> lock(mu);
        dst[t].narrow(0, e0, x.numel()).copy_(x.reshape(-1));
      };
      for (size_t t = 0; t < kBlockShapes.size(); ++t) {
        const at::Tensor g = seeded_randn(kBlockShapes[t].shape, seed, 1000 + 100 * k + t);
        shards[t].grad.copy_(rows_view(g, kBlockShapes[t]).narrow(0, shards[t].row_begin, shards[t].rows()));
        put(run.m_before[k], t, muon.momentum(t));
        put(run.p_before[k], t, shards[t].param);
      }
      muon.step();
      for (size_t t = 0; t < kBlockShapes.size(); ++t) {
        put(run.p_after[k], t, shards[t].param);
        if (dtype != at::kByte) continue;
        put(run.codes[k], t, muon.state(t)[0].second);
        const at::Tensor a = muon.state(t)[1].second;
        const int64_t b0 = shards[t].row_begin * shards[t].row_len / kBlock;
        std::lock_guard<std::mutex> lock(mu);
        run.absmax[k][t].narrow(0, b0, a.numel()).copy_(a);
      }
    }
  });
  return run;
}

TEST(MuonLowBit, EightBitMomentumEqualsTheFloat64QuantisedAlgorithmOnAnyWorld) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  constexpr int kSteps = 6;
  MuonOptions h;
  h.lr = 0.02;
  h.momentum = 0.9;
  h.weight_decay = 0.01;
  const at::Tensor c = quant::dynamic_map(true);
  const std::vector<double> code(c.data_ptr<float>(), c.data_ptr<float>() + 256);
  const LowBitRun one = run_low_bit(1, seed, at::kByte, kSteps, h);
  int64_t checked = 0, ambiguous_codes = 0;
  for (int k = 0; k < kSteps; ++k) {
    for (size_t t = 0; t < kBlockShapes.size(); ++t) {
      const std::string where = kBlockShapes[t].name + ", step " + std::to_string(k + 1);
      // The gradient the optimizer was given (fp32), in float64.
      const at::Tensor g = seeded_randn(kBlockShapes[t].shape, seed, 1000 + 100 * k + t).to(at::kDouble).reshape(-1);
      const at::Tensor m0 = one.m_before[k][t].to(at::kDouble);
      const at::Tensor m = m0 + (1 - h.momentum) * (g - m0);
      const CodeCheck cc = expect_block_codes(one.codes[k][t], one.absmax[k][t], m, kBlock, code, 1e-6, where);
      checked += cc.checked;
      ambiguous_codes += cc.skipped;
      // The parameters: a float64 Muon step from the decoded momentum.
      at::Tensor w = one.p_before[k][t].to(at::kDouble).view(kBlockShapes[t].shape).clone();
      at::Tensor mm = m0.view(kBlockShapes[t].shape).clone();
      ref_step(w, mm, g.view(kBlockShapes[t].shape), h);
      const double err = (one.p_after[k][t].to(at::kDouble) - w.reshape(-1)).abs().max().item<double>();
      EXPECT_LT(err, 2e-5 * (1 + w.abs().max().item<double>())) << where;
    }
  }
  EXPECT_GT(checked, 1000);
  std::cout << "[ figure ] " << checked << " codes checked, " << ambiguous_codes
            << " on a rounding midpoint\n";
  for (int world : {2, 4, 8, 16}) {  // codes and scales do not depend on the world
    const LowBitRun other = run_low_bit(world, seed, at::kByte, kSteps, h);
    for (int k = 0; k < kSteps; ++k) {
      for (size_t t = 0; t < kBlockShapes.size(); ++t) {
        EXPECT_TRUE(at::equal(other.codes[k][t], one.codes[k][t])) << world << " ranks, step " << k;
        EXPECT_TRUE(at::equal(other.absmax[k][t], one.absmax[k][t])) << world << " ranks, step " << k;
      }
    }
  }
}

TEST(MuonLowBit, EightBitMomentumOnTheDeviceGenericPathEqualsTheCpuKernels) {
  // What a GPU runs (ATen operations: quant/kernels/aten/generic_ops.h), here on the
  // CPU: momenta, codes, scales and parameters bit for bit the CPU kernels' run, on
  // 1, 2 and 4 ranks.
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  MuonOptions h;
  h.lr = 0.02;
  h.momentum = 0.9;
  h.weight_decay = 0.01;
  for (int world : {1, 2, 4}) {
    const LowBitRun kernels = run_low_bit(world, seed, at::kByte, 4, h);
    quant::use_device_generic_path(true);
    const LowBitRun generic = run_low_bit(world, seed, at::kByte, 4, h);
    quant::use_device_generic_path(false);
    for (int k = 0; k < 4; ++k) {
      for (size_t t = 0; t < kBlockShapes.size(); ++t) {
        SCOPED_TRACE(std::to_string(world) + " ranks, step " + std::to_string(k + 1) + ", " +
                     kBlockShapes[t].name);
        EXPECT_TRUE(at::equal(generic.m_before[k][t], kernels.m_before[k][t])) << "momentum";
        EXPECT_TRUE(at::equal(generic.codes[k][t], kernels.codes[k][t])) << "codes";
        EXPECT_TRUE(at::equal(generic.absmax[k][t], kernels.absmax[k][t])) << "absmax";
        EXPECT_TRUE(at::equal(generic.p_after[k][t], kernels.p_after[k][t])) << "parameters";
      }
    }
  }
}

TEST(MuonLowBit, Bf16MomentumIsTheRoundedFloat64Update) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  MuonOptions h;
  h.momentum = 0.95;
  const LowBitRun run = run_low_bit(2, seed, at::kBFloat16, 4, h);
  for (int k = 0; k + 1 < 4; ++k) {
    for (size_t t = 0; t < kBlockShapes.size(); ++t) {
      const at::Tensor g = seeded_randn(kBlockShapes[t].shape, seed, 1000 + 100 * k + t).to(at::kDouble).reshape(-1);
      const at::Tensor m0 = run.m_before[k][t].to(at::kDouble);
      const at::Tensor want = m0 + (1 - h.momentum) * (g - m0);
      const at::Tensor got = run.m_before[k + 1][t].to(at::kDouble);
      EXPECT_TRUE(((got - want).abs() <= want.abs() * std::ldexp(1.0, -7) + 1e-30).all().item<bool>())
          << kBlockShapes[t].name << ", step " << k + 1;
      EXPECT_TRUE(at::equal(got, got.to(at::kBFloat16).to(at::kDouble)));  // bf16 values
    }
  }
}

TEST(MuonLowBit, ShardsThatCutABlockAndBadSettingsAreClearErrors) {
  MuonConfig o;
  o.momentum_dtype = at::kByte;
  o.momentum_block = 64;
  // Rows [0, 3) and [3, 24) of 24 x 40: a cut at element 120, inside a block of 64.
  run_local_ranks(2, [&](Comm& comm) {
    const int64_t b = comm.rank() == 0 ? 0 : 3, e = comm.rank() == 0 ? 3 : 24;
    ParamShard cut(TensorShard::rows_of("w", {24, 40}, 1, b, e), at::zeros({e - b, 40}));
    try {
      Muon m({cut}, {}, o, std::shared_ptr<Comm>(&comm, [](Comm*) {}));
      ADD_FAILURE() << "a cut block was accepted";
    } catch (const std::invalid_argument& err) {
      EXPECT_NE(std::string(err.what()).find("'w'"), std::string::npos) << err.what();
      EXPECT_NE(std::string(err.what()).find("(8 rows"), std::string::npos) << err.what();
    }
  });
  o.momentum_map = "cubic";
  EXPECT_THROW(Muon({whole_param("w", at::zeros({4, 4}), {})}, {}, o), std::invalid_argument);
  o.momentum_map = "dynamic";
  o.momentum_dtype = at::kHalf;
  EXPECT_THROW(Muon({whole_param("w", at::zeros({4, 4}), {})}, {}, o), std::invalid_argument);
}

TEST(NewtonSchulz, SingularValuesNearOneInFloat32AndBf16) {
  const uint64_t seed = fresh_seed();
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    const at::Tensor g = seeded_randn({24, 40}, seed, 0);
    const at::Tensor o = newton_schulz(g, 5, dtype);
    ASSERT_EQ(o.scalar_type(), at::kFloat);
    const at::Tensor sv = std::get<1>(at::linalg_svd(o.to(at::kDouble), false));
    // The quintic iteration drives singular values into a band around 1 (about
    // [0.6, 1.2] after 5 steps for a Gaussian matrix), not to 1 exactly.
    EXPECT_GT(sv.min().item<double>(), 0.5) << "seed " << seed;
    EXPECT_LT(sv.max().item<double>(), 1.3) << "seed " << seed;
    const at::Tensor ref = ref_orthogonalise(g.to(at::kDouble), 5);
    const at::Tensor diff = o.to(at::kDouble) - ref;
    if (dtype == at::kFloat) {
      EXPECT_LT(diff.abs().max().item<double>(), 1e-5) << "seed " << seed;
    } else {  // bf16 keeps 8 significant bits; the iteration spreads that to ~15% (measured)
      EXPECT_LT(diff.norm().item<double>() / ref.norm().item<double>(), 0.25) << "seed " << seed;
    }
  }
}

TEST(NewtonSchulz, BatchEqualsOneMatrixAtATime) {
  const uint64_t seed = fresh_seed();
  // wide and tall (transposed inside) batches
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{5, 12, 20},
                                            std::vector<int64_t>{4, 30, 9}}) {
    const at::Tensor g = seeded_randn(shape, seed, shape[1]);
    const at::Tensor batch = newton_schulz(g, 5, at::kFloat);
    ASSERT_EQ(batch.sizes(), g.sizes());
    for (int64_t k = 0; k < shape[0]; ++k) {
      const at::Tensor ref = ref_orthogonalise(g[k].to(at::kDouble), 5);
      EXPECT_LT((batch[k].to(at::kDouble) - ref).abs().max().item<double>(), 1e-5)
          << "seed " << seed << ", matrix " << k;
    }
  }
  EXPECT_THROW(newton_schulz(at::zeros({2, 2, 2, 2}), 5), std::invalid_argument);
}

TEST(Muon, WithItsAdamWPartOneStepIsTwoAllToAllsAndOneAgreement) {
  // Matrices cut between 2 ranks and a bias (the AdamW part): the gather and the
  // scatter of the matrices, and one all-reduce that agrees the gradients'
  // NaN/Inf check and Newton-Schulz's failures for both parts.
  run_local_ranks(2, [](Comm& comm) {
    const std::vector<std::pair<int64_t, int64_t>> every = {{0, 3}, {3, 8}};
    const auto [b, e] = every[comm.rank()];
    std::vector<ParamShard> shards;
    for (const char* name : {"w1", "w2"}) {
      shards.emplace_back(TensorShard::rows_of(name, {8, 6}, 1, b, e, every), at::randn({e - b, 6}),
                          at::randn({e - b, 6}));
    }
    shards.emplace_back(TensorShard::rows_of("bias", {8}, 1, b, e, every), at::randn({e - b}),
                        at::randn({e - b}));
    Muon muon(shards, {}, {}, std::shared_ptr<Comm>(&comm, [](Comm*) {}), {}, {true, true, false});
    const at::Tensor bias = shards[2].param.clone();
    comm.reset_stats();
    muon.step();
    EXPECT_EQ(comm.stats().collectives, 3);
    EXPECT_FALSE(at::equal(shards[2].param, bias));  // the AdamW part stepped
    EXPECT_EQ(muon.state(2)[0].first, "exp_avg");
    EXPECT_TRUE(muon.state_has_step(2));
    EXPECT_FALSE(muon.state_has_step(0));
  });
}

TEST(MuonColumnParts, PiecesOfColumnBlocksMatchSingleDeviceReference) {
  // Tensor parallelism's Shard(1) (RowwiseParallel) under FSDP's row chunks: a
  // 7 x 12 matrix in 2 column parts of 6, each cut into rows 4 + 3, on 4 ranks
  // (rank r: part r % 2, chunk r / 2), and a 5 x 9 one in 3 parts held whole
  // by ranks 0-2 (rank 3 none); each matrix whole on its root, as one device.
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  constexpr int kSteps = 4;
  const MuonOptions h;
  const std::vector<ColumnPartsMatrix> mats = {
      {"w0", {7, 12}, 2, {{0, 4}, {0, 4}, {4, 7}, {4, 7}}},
      {"w1", {5, 9}, 3, {{0, 5}, {0, 5}, {0, 5}, {0, 0}}}};
  std::vector<at::Tensor> w, m;
  for (size_t t = 0; t < mats.size(); ++t) {
    w.push_back(seeded_randn(mats[t].shape, seed, t, at::kDouble));
    m.push_back(at::zeros_like(w.back()));
  }
  const std::vector<at::Tensor> init = {w[0].clone(), w[1].clone()};
  auto grad_at = [&](int step, size_t t) {
    return seeded_randn(mats[t].shape, seed, 1000 + step * 100 + t, at::kDouble);
  };
  for (int step = 0; step < kSteps; ++step) {
    for (size_t t = 0; t < mats.size(); ++t) ref_step(w[t], m[t], grad_at(step, t), h);
  }
  auto piece = [&](const at::Tensor& full, size_t t, int r) { return mats[t].piece(full, r); };
  std::mutex mu;
  std::map<int, std::string> failures;
  run_local_ranks(4, [&](Comm& comm) {
    const int r = comm.rank();
    std::vector<ParamShard> shards;
    for (size_t t = 0; t < mats.size(); ++t) {
      ParamShard p(mats[t].shard(r), piece(init[t], t, r).to(at::kFloat).contiguous());
      p.grad = at::zeros_like(p.param);
      shards.push_back(p);
    }
    Muon muon(shards, h, {}, std::shared_ptr<Comm>(&comm, [](Comm*) {}));
    for (int step = 0; step < kSteps; ++step) {
      for (size_t t = 0; t < mats.size(); ++t) shards[t].grad.copy_(piece(grad_at(step, t), t, r));
      muon.step();
    }
    for (size_t t = 0; t < mats.size(); ++t) {
      const at::Tensor want = piece(w[t], t, r);
      if (want.numel() == 0) continue;
      const double err = (shards[t].param.to(at::kDouble) - want).abs().max().item<double>();
      if (!(err <= 2e-5 * (1 + want.abs().max().item<double>()))) {
        std::lock_guard<std::mutex> lock(mu);
        failures[r] += "w" + std::to_string(t) + ": max error " + std::to_string(err) + "; ";
      }
    }
  });
  for (const auto& [r, msg] : failures) ADD_FAILURE() << "rank " << r << ": " << msg;
}

TEST(MuonColumnParts, Int8MomentumOnColumnPartsIsRefusedNamingWhatTakesThem) {
  MuonConfig c;
  c.momentum_dtype = at::kByte;
  c.momentum_block = 4;
  try {  // (the two column parts' rows, 4 wide, one after another)
    Muon({ParamShard(TensorShard::column_parts("proj", {4, 8}, 2, 0, 8), at::zeros({8, 4}),
                     at::zeros({8, 4}))},
         MuonOptions{}, c);
    FAIL() << "int8 momentum on column parts was taken";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'proj' is held in 2 column parts"), std::string::npos) << what;
    EXPECT_NE(what.find("Muon with momentum_dtype torch.float32"), std::string::npos) << what;
  }
}

TEST(MuonColumnParts, SplitSizesOnColumnPartsAreRefusedNamingThem) {
  try {
    MuonLayout(nullptr, {TensorShard::column_parts("proj", {4, 8}, 2, 0, 8)}, {5}, {{2, 2}});
    FAIL() << "split_sizes on column parts were taken";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'proj' is held in 2 column parts"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace rfsdp
