// AdamW against torch.optim.AdamW's formula (float64 transcription); AdamW8bit
// against fp32 AdamW on a regression, and its step element by element against a
// float64 transcription; 8-bit results on 2 and 4 shards equal the unsharded
// result bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <iostream>
#include <map>
#include <mutex>
#include <random>

#include "tests/support/local_ranks.h"
#include "core/ragged/planner.h"
#include "fsdp/fsdp_unit.h"
#include "optimizers/adamw/adamw.h"
#include "optimizers/common/requantize.h"
#include "quant/ops.h"
#include "tests/cpp/quant_isas.h"
#include "tests/cpp/column_parts_test_util.h"
#include "tests/cpp/test_util.h"

namespace rfsdp {
namespace {

using testing::ColumnPartsMatrix;
using testing::fresh_seed;
using testing::nearest_code;
using testing::seeded_randn;

// AdamW8bit's config of these blocks (min_8bit_size: tensors smaller keep fp32 moments).
AdamW8bitConfig blocks8(quant::BlockShape block, int64_t min_8bit_size = AdamW8bitConfig{}.min_8bit_size) {
  AdamW8bitConfig c;
  c.block = block;
  c.min_8bit_size = min_8bit_size;
  return c;
}

// Whole tensors of these shapes, random (seeded) with zero gradients: p, g hold them.
std::vector<ParamShard> whole_params(const std::vector<std::vector<int64_t>>& shapes, uint64_t seed,
                                     std::vector<at::Tensor>* p, std::vector<at::Tensor>* g) {
  std::vector<ParamShard> shards;
  for (size_t i = 0; i < shapes.size(); ++i) {
    p->push_back(seeded_randn(shapes[i], seed, i));
    g->push_back(at::zeros(shapes[i]));
    shards.push_back(whole_param("p" + std::to_string(i), p->back(), g->back()));
  }
  return shards;
}

TEST(AdamW, EqualsTorchAdamWFormulaOver100Steps) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<std::vector<int64_t>> shapes = {{17, 9}, {300}, {2, 3, 5}};
  AdamWOptions o;
  o.lr = 3e-3;
  o.beta1 = 0.85;
  o.beta2 = 0.99;
  o.eps = 1e-8;
  o.weight_decay = 0.1;
  std::vector<at::Tensor> p, g;
  const std::vector<ParamShard> shards = whole_params(shapes, seed, &p, &g);
  AdamW opt(shards, o);
  // Reference, float64: torch.optim.AdamW's single-tensor update.
  std::vector<at::Tensor> rp, rm, rv;
  for (auto& t : p) {
    rp.push_back(t.to(at::kDouble));
    rm.push_back(at::zeros_like(rp.back()));
    rv.push_back(at::zeros_like(rp.back()));
  }
  for (int step = 1; step <= 100; ++step) {
    for (size_t i = 0; i < p.size(); ++i) {
      g[i].copy_(seeded_randn(shapes[i], seed, 1000 * step + i));
      const at::Tensor gd = g[i].to(at::kDouble);
      rp[i].mul_(1 - o.lr * o.weight_decay);
      rm[i].mul_(o.beta1).add_(gd, 1 - o.beta1);
      rv[i].mul_(o.beta2).addcmul_(gd, gd, 1 - o.beta2);
      const double bc1 = 1 - std::pow(o.beta1, step), bc2 = 1 - std::pow(o.beta2, step);
      const at::Tensor denom = (rv[i].sqrt() / std::sqrt(bc2)).add_(o.eps);
      rp[i].addcdiv_(rm[i], denom, -o.lr / bc1);
    }
    opt.step();
  }
  for (size_t i = 0; i < p.size(); ++i) {
    const double err = (p[i].to(at::kDouble) - rp[i]).abs().max().item<double>();
    EXPECT_LT(err, 2e-5) << "tensor " << i;
    EXPECT_TRUE(at::allclose(opt.exp_avg(i).to(at::kDouble), rm[i], 1e-4, 1e-6));
    EXPECT_TRUE(at::allclose(opt.exp_avg_sq(i).to(at::kDouble), rv[i], 1e-4, 1e-8));
  }
  EXPECT_EQ(opt.steps(), 100);
}

// The fused path (torch's multi-tensor kernel: GPU parameters always take it;
// fused_on_cpu makes the CPU take it too, so it is tested here): one launch per
// group and step, whatever the number of parameters, and each parameter's
// update is torch.optim.AdamW's formula with its own group's options and its
// own step count (parameters skip steps).
TEST(AdamW, FusedPathLaunchesOncePerGroupAndEqualsFloat64Formula) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<std::vector<int64_t>> shapes = {{17, 9}, {300}, {2, 3, 5}, {0, 4}, {33}, {8, 8}};
  const std::vector<size_t> group = {0, 1, 0, 1, 2, 2};
  std::vector<AdamWOptions> go(3);
  go[0].lr = 3e-3, go[0].beta1 = 0.85, go[0].beta2 = 0.99, go[0].weight_decay = 0.1;
  go[1].lr = 1e-2, go[1].beta1 = 0.9, go[1].beta2 = 0.95, go[1].weight_decay = 0.0;
  go[2].lr = 5e-4, go[2].beta1 = 0.5, go[2].beta2 = 0.999, go[2].eps = 1e-6;
  std::vector<at::Tensor> p, g;
  const std::vector<ParamShard> shards = whole_params(shapes, seed, &p, &g);
  AdamWOptions defaults;
  defaults.fused_on_cpu = true;
  AdamW opt(shards, defaults);
  opt.set_groups(group);
  for (size_t k = 0; k < 3; ++k) opt.set_group_options(k, go[k]);
  std::vector<at::Tensor> rp, rm, rv;
  std::vector<int64_t> count(p.size(), 0);
  for (auto& t : p) {
    rp.push_back(t.to(at::kDouble));
    rm.push_back(at::zeros_like(rp.back()));
    rv.push_back(at::zeros_like(rp.back()));
  }
  std::mt19937_64 rng(seed);
  for (int step = 1; step <= 20; ++step) {
    std::vector<bool> has(p.size());
    std::vector<bool> group_steps(3, false);
    for (size_t i = 0; i < p.size(); ++i) {
      has[i] = rng() % 4 != 0;  // a quarter of the parameters skip a step
      opt.set_grad(i, has[i] ? g[i] : at::Tensor());
      if (!has[i]) continue;
      g[i].copy_(seeded_randn(shapes[i], seed, 1000 * step + i));
      if (p[i].numel() > 0) group_steps[group[i]] = true;
      const AdamWOptions& o = go[group[i]];
      const int64_t t = ++count[i];
      const at::Tensor gd = g[i].to(at::kDouble);
      rp[i].mul_(1 - o.lr * o.weight_decay);
      rm[i].mul_(o.beta1).add_(gd, 1 - o.beta1);
      rv[i].mul_(o.beta2).addcmul_(gd, gd, 1 - o.beta2);
      const double bc1 = 1 - std::pow(o.beta1, t), bc2 = 1 - std::pow(o.beta2, t);
      rp[i].addcdiv_(rm[i], (rv[i].sqrt() / std::sqrt(bc2)).add_(o.eps), -o.lr / bc1);
    }
    const int64_t before = opt.fused_launches();
    opt.step();
    EXPECT_EQ(opt.fused_launches() - before,
              std::count(group_steps.begin(), group_steps.end(), true))
        << "step " << step;
  }
  for (size_t i = 0; i < p.size(); ++i) {
    EXPECT_EQ(opt.step_count(i), count[i]) << "tensor " << i;
    const at::Tensor err = (p[i].to(at::kDouble) - rp[i]).abs();
    const at::Tensor bound = 2e-6 + 1e-5 * rp[i].abs();
    EXPECT_TRUE((err <= bound).all().item<bool>())
        << "tensor " << i << ": max error " << (p[i].numel() ? err.max().item<double>() : 0.0);
  }
}

// Linear regression y = x w*^T + b* + noise, trained by `Opt` from one init.
template <class MakeOpt>
double regression_loss(uint64_t seed, MakeOpt make_opt, int steps) {
  const int64_t n = 256, din = 64, dout = 96;
  const at::Tensor x = seeded_randn({n, din}, seed, 1);
  const at::Tensor y = at::matmul(x, seeded_randn({dout, din}, seed, 2).t()) +
                       seeded_randn({dout}, seed, 3) + 0.1 * seeded_randn({n, dout}, seed, 4);
  at::Tensor w = 0.1 * seeded_randn({dout, din}, seed, 5), b = at::zeros({dout});
  at::Tensor gw = at::zeros_like(w), gb = at::zeros_like(b);
  auto opt = make_opt(std::vector<ParamShard>{whole_param("w", w, gw), whole_param("b", b, gb)});
  double loss = 0;
  const AdamWOptions o0 = opt->group_options(0);
  for (int s = 0; s < steps; ++s) {
    AdamWOptions o = o0;
    o.lr = o0.lr * (1.0 - static_cast<double>(s) / steps);  // linear decay
    opt->set_group_options(0, o);
    const at::Tensor err = at::matmul(x, w.t()) + b - y;  // d(mean err^2)/d...
    loss = err.pow(2).mean().item<double>();
    gw.copy_(2.0 / (n * dout) * at::matmul(err.t(), x));
    gb.copy_(2.0 / (n * dout) * err.sum(0));
    opt->step();
  }
  return loss;
}

TEST(AdamW8bit, TracksFp32AdamWOnARegression) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  AdamWOptions o;
  o.lr = 3e-2;
  o.weight_decay = 0;
  constexpr int kSteps = 1000;
  const double l32 = regression_loss(
      seed, [&](std::vector<ParamShard> p) { return std::make_unique<AdamW>(p, o); }, kSteps);
  bool w_is_8bit = false;
  const double l8 = regression_loss(
      seed,
      [&](std::vector<ParamShard> p) {
        auto opt = std::make_unique<AdamW8bit>(p, o);
        w_is_8bit = opt->is_8bit(0) && !opt->is_8bit(1);  // w: 6144 elements; b: 96
        return opt;
      },
      kSteps);
  EXPECT_TRUE(w_is_8bit);
  const double rel = std::fabs(l8 - l32) / l32;
  std::cout << "[ figure ] regression after " << kSteps << " steps: fp32 AdamW loss " << l32
            << ", AdamW8bit loss " << l8 << ", relative difference " << rel << "\n";
  RecordProperty("relative_loss_difference", std::to_string(rel));
  EXPECT_LT(rel, 0.05);
  EXPECT_LT(l32, 0.05);  // both actually fit (noise variance 0.01)
}

struct Tensor8 {
  std::string name;
  std::vector<int64_t> shape;
};

// Runs AdamW8bit for `steps` on whole tensors, or on the shards a plan for
// world size m gives, and returns the final parameters and moments.
std::vector<at::Tensor> run_8bit(const std::vector<Tensor8>& ts, quant::BlockShape block,
                                 int64_t m, uint64_t seed, int steps) {
  std::vector<TensorSpec> specs;
  for (const auto& t : ts) {
    TensorSpec s;
    s.name = t.name;
    s.shape = t.shape;
    s.granule_rows = block.granule_rows(s.row_elems());
    specs.push_back(s);
  }
  const Plan plan = plan_unit(specs, m, 16);
  std::vector<at::Tensor> full_p;
  for (size_t i = 0; i < ts.size(); ++i) full_p.push_back(seeded_randn(ts[i].shape, seed, i));
  // Per rank: its rows of each tensor (copies), an optimizer over them.
  std::vector<std::vector<at::Tensor>> p(m), g(m);
  std::vector<std::unique_ptr<AdamW8bit>> opts;
  for (int64_t r = 0; r < m; ++r) {
    std::vector<ParamShard> shards;
    for (size_t i = 0; i < ts.size(); ++i) {
      const ShardRange sr = plan.shard(i, r);
      const int64_t row_len = specs[i].row_elems();
      p[r].push_back(full_p[i].reshape({-1, row_len}).slice(0, sr.row_begin, sr.row_end).clone());
      g[r].push_back(at::zeros_like(p[r].back()));
      shards.emplace_back(TensorShard::of_plan(plan, i, r), p[r].back(), g[r].back());
    }
    AdamWOptions o;
    o.lr = 1e-2;
    opts.push_back(std::make_unique<AdamW8bit>(shards, o, blocks8(block)));
  }
  for (int step = 0; step < steps; ++step) {
    for (size_t i = 0; i < ts.size(); ++i) {
      const at::Tensor full_g = seeded_randn(ts[i].shape, seed, 100 + 10 * step + i)
                                    .reshape({-1, specs[i].row_elems()});
      for (int64_t r = 0; r < m; ++r) {
        const ShardRange sr = plan.shard(i, r);
        g[r][i].copy_(full_g.slice(0, sr.row_begin, sr.row_end));
      }
    }
    for (auto& o : opts) o->step();
  }
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < ts.size(); ++i) {
    std::vector<at::Tensor> pp, mm, vv;
    for (int64_t r = 0; r < m; ++r) {
      pp.push_back(p[r][i].reshape(-1));
      mm.push_back(opts[r]->exp_avg(i).reshape(-1));
      vv.push_back(opts[r]->exp_avg_sq(i).reshape(-1));
    }
    out.push_back(at::cat(pp));
    out.push_back(at::cat(mm));
    out.push_back(at::cat(vv));
  }
  return out;
}

TEST(AdamW8bit, ShardedEqualsUnshardedExactly) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<std::pair<quant::BlockShape, std::vector<Tensor8>>> configs = {
      {quant::BlockShape::blocks(256), {{"a", {300, 40}}, {"small", {50}}, {"d", {5000}}}},
      {quant::BlockShape::blocks(2048), {{"a", {300, 40}}, {"e", {70, 45}}}},
      {quant::BlockShape::tiles(32, 32), {{"b", {96, 96}}, {"e", {70, 45}}, {"f", {128, 40}}}}};
  for (const auto& [block, ts] : configs) {
    const auto whole = run_8bit(ts, block, 1, seed, 8);
    for (int64_t m : {2, 4}) {
      const auto sharded = run_8bit(ts, block, m, seed, 8);
      for (size_t k = 0; k < whole.size(); ++k) {
        ASSERT_TRUE(at::equal(whole[k], sharded[k]))
            << block.str() << " m " << m << " tensor " << ts[k / 3].name << " part " << k % 3;
      }
    }
  }
}

TEST(AdamW8bit, StatePrecisionFollowsTheFullTensorSize) {
  // 5000 elements in 4 shards of 1250: still 8-bit; 3000 elements: fp32 everywhere.
  for (int64_t n : {5000, 3000}) {
    at::Tensor p = at::zeros({n / 4}), g = at::zeros({n / 4});
    ParamShard s(TensorShard::rows_of("t", {n}, 1, 0, n / 4), p, g);
    AdamW8bit opt({s}, {}, blocks8(quant::BlockShape::blocks(250)));
    EXPECT_EQ(opt.is_8bit(0), n >= 4096);
  }
}

TEST(AdamW8bit, ShardCuttingABlockIsAClearError) {
  at::Tensor p = at::zeros({10, 40}), g = at::zeros({10, 40});
  // rows from 5 (element 200: inside the first 256-element block)
  ParamShard s(TensorShard::rows_of("w", {300, 40}, 1, 5, 15), p, g);
  try {
    AdamW8bit opt({s});
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'w'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("32 rows"), std::string::npos) << msg;  // 256 / gcd(256, 40)
  }
}

TEST(AdamW8bit, OnTheShardsOfAnFsdpUnit) {
  // A unit planned with the 8-bit granule holds whole blocks; one planned with
  // 1-row granules splits the 12000 elements at row 150 (element 6000: inside a
  // block), which the two ranks then share. Both step as one device, bit for bit.
  TensorSpec w;
  w.name = "w";
  w.shape = {300, 40};
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (int64_t granule : {int64_t{32}, int64_t{1}}) {
    SCOPED_TRACE("granule " + std::to_string(granule));
    w.granule_rows = granule;
    const Plan plan = plan_unit({w}, 2, 16);
    if (granule == 1) ASSERT_EQ(plan.shard(0, 1).row_begin, 150);
    run_local_ranks(2, [&](Comm& c) {
      auto comm = std::shared_ptr<Comm>(&c, [](Comm*) {});
      FSDPUnit unit(comm, plan);
      const at::Tensor full = testing::seeded_randn({300, 40}, seed, 0);
      const at::Tensor grad = testing::seeded_randn({300, 40}, seed, 1);
      unit.shard({full});
      const ShardRange range = unit.shard_range(0);
      AdamW8bit opt(param_shards(unit), {}, blocks8(quant::BlockShape::blocks(256), 4096), comm);
      EXPECT_EQ(opt.shared_blocks(), granule == 1 ? 1 : 0);
      at::Tensor whole_p = full.clone(), whole_g = grad.clone();
      AdamW8bit whole({whole_param("w", whole_p, whole_g)});
      for (int step = 0; step < 3; ++step) {
        unit.local_grad(0).copy_(grad.narrow(0, range.row_begin, range.row_end - range.row_begin));
        opt.step();
        whole.step();
      }
      EXPECT_TRUE(at::equal(unit.local_param(0),
                            whole_p.narrow(0, range.row_begin, range.row_end - range.row_begin)));
      EXPECT_FALSE(at::equal(whole_p, full));
    });
  }
}

// Every rank's rows [begin, end) of n rows as torch.chunk splits them (FSDP2's split).
std::vector<std::pair<int64_t, int64_t>> chunk_rows(int64_t n, int64_t world) {
  const int64_t c = (n + world - 1) / world;
  std::vector<std::pair<int64_t, int64_t>> rows;
  for (int64_t r = 0; r < world; ++r) rows.push_back({std::min(r * c, n), std::min((r + 1) * c, n)});
  return rows;
}

TEST(AdamW8bit, BlocksThatShardsCutAreAgreedAndEqualOneDeviceBitForBit) {
  // torch.chunk rows over 2-16 ranks cut blocks: at one end or both, a block
  // spread over three ranks (20 x 16 = 320 elements, 112 a rank), a rank with no
  // rows (5 rows over 4 ranks), rows of tiles cut, ranks with no rows of a tiled
  // tensor (70 rows over 16: ranks 14 and 15; they once counted the shared tile
  // rows as rows, not tiles, and their agreement's size mismatched the others'). Each rank's parameter, codes
  // and absmax equal the one-device optimizer's (its rows; its blocks' entries)
  // bit for bit after every step. Without the agreement (each rank quantising its
  // rows as a tensor of its own, what a shard-local 8-bit optimizer does) they differ.
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<std::pair<quant::BlockShape, std::vector<Tensor8>>> configs = {
      {quant::BlockShape::blocks(256), {{"a", {300, 40}}, {"t", {20, 16}}, {"e", {5, 300}}}},
      {quant::BlockShape::tiles(32, 32), {{"b", {70, 45}}, {"f", {130, 40}}}}};
  for (const auto& [block, ts] : configs) {
    for (int world : {2, 3, 4, 8, 16}) {
      SCOPED_TRACE(block.str() + ", " + std::to_string(world) + " ranks");
      // The one-device run: every step's parameters, codes and absmax.
      std::vector<at::Tensor> wp, wg;
      std::vector<ParamShard> whole_shards;
      for (size_t i = 0; i < ts.size(); ++i) {
        wp.push_back(seeded_randn(ts[i].shape, seed, i));
        wg.push_back(at::zeros(ts[i].shape));
        whole_shards.push_back(whole_param(ts[i].name, wp.back(), wg.back()));
      }
      AdamWOptions o;
      o.lr = 1e-2;
      AdamW8bit whole(whole_shards, o, blocks8(block, 1));
      const int steps = 4;
      std::vector<std::vector<std::vector<at::Tensor>>> want(steps);  // [step][tensor] p, q1, a1, q2, a2
      auto grad_of = [&](size_t i, int step) {
        return seeded_randn(ts[i].shape, seed, 100 + 10 * step + i);
      };
      for (int step = 0; step < steps; ++step) {
        for (size_t i = 0; i < ts.size(); ++i) wg[i].copy_(grad_of(i, step));
        whole.step();
        for (size_t i = 0; i < ts.size(); ++i) {
          std::vector<at::Tensor> w = {wp[i].clone()};
          for (const auto& kv : whole.state(i)) w.push_back(kv.second.clone());
          want[step].push_back(w);
        }
      }
      std::atomic<int> differ_without{0};
      // The CPU kernels, then the device-generic path (what a GPU runs), against the
      // one device's CPU kernels.
      for (bool generic : {false, true}) {
      SCOPED_TRACE(generic ? "device-generic path" : "CPU kernels");
      quant::use_device_generic_path(generic);
      run_local_ranks(world, [&](Comm& c) {
        auto comm = std::shared_ptr<Comm>(&c, [](Comm*) {});
        const int r = c.rank();
        std::vector<at::Tensor> p, g, lp, lg;
        std::vector<ParamShard> shards, local_shards;
        std::vector<std::pair<int64_t, int64_t>> mine;
        for (size_t i = 0; i < ts.size(); ++i) {
          const auto rows = chunk_rows(ts[i].shape[0], world);
          const auto [b, e] = rows[r];
          mine.push_back(rows[r]);
          p.push_back(seeded_randn(ts[i].shape, seed, i).narrow(0, b, e - b).clone());
          g.push_back(at::zeros_like(p.back()));
          shards.emplace_back(TensorShard::rows_of(ts[i].name, ts[i].shape, 1, b, e, rows),
                              p.back(), g.back());
          lp.push_back(p.back().clone());
          lg.push_back(at::zeros_like(p.back()));
          local_shards.push_back(whole_param(ts[i].name, lp.back(), lg.back()));
        }
        AdamW8bit opt(shards, o, blocks8(block, 1), comm);
        AdamW8bit shard_local(local_shards, o, blocks8(block, 1));
        for (int step = 0; step < steps; ++step) {
          for (size_t i = 0; i < ts.size(); ++i) {
            const auto [b, e] = mine[i];
            g[i].copy_(grad_of(i, step).narrow(0, b, e - b));
            lg[i].copy_(g[i]);
          }
          opt.step();
          shard_local.step();
          for (size_t i = 0; i < ts.size(); ++i) {
            SCOPED_TRACE("step " + std::to_string(step) + ", '" + ts[i].name + "', rank " +
                         std::to_string(r));
            const auto [b, e] = mine[i];
            const int64_t row_len = p[i].numel() / std::max<int64_t>(1, e - b);
            const auto span = opt.block_span(i);
            const auto st = opt.state(i);
            const auto& w = want[step][i];
            ASSERT_TRUE(at::equal(p[i], w[0].narrow(0, b, e - b)));
            ASSERT_EQ(st.size(), 4u);
            for (int k : {0, 2}) {  // codes: this rank's elements
              const int64_t n = st[k].second.numel();
              ASSERT_TRUE(at::equal(st[k].second, w[1 + k].narrow(0, b * (n ? row_len : 0), n)))
                  << st[k].first;
            }
            for (int k : {1, 3}) {  // absmax: the blocks this rank touches
              ASSERT_TRUE(at::equal(st[k].second,
                                    w[1 + k].narrow(0, span.first, st[k].second.numel())))
                  << st[k].first;
            }
            if (!at::equal(lp[i], p[i])) ++differ_without;
          }
        }
      });
      quant::use_device_generic_path(false);
      }
      EXPECT_GT(differ_without.load(), 0) << "shard-local quantisation gave the same result";
    }
  }
}

TEST(AdamW8bit, SharedBlockWithAGradientOnOnlySomeRanksIsAnErrorEverywhere) {
  // 300 x 40 over 3 ranks: rows 100 (element 4000) and 200 cut blocks. Rank 1
  // gives no gradient: every rank raises, nothing changes, the step does not count.
  run_local_ranks(3, [&](Comm& c) {
    auto comm = std::shared_ptr<Comm>(&c, [](Comm*) {});
    const auto rows = chunk_rows(300, 3);
    const auto [b, e] = rows[c.rank()];
    at::Tensor p = at::randn({e - b, 40}), g = at::randn({e - b, 40});
    AdamW8bit opt({ParamShard(TensorShard::rows_of("w", {300, 40}, 1, b, e, rows), p,
                              c.rank() == 1 ? at::Tensor() : g)},
                  {}, blocks8(quant::BlockShape::blocks(256), 4096), comm);
    const at::Tensor before = p.clone(), q1 = opt.state(0)[0].second.clone();
    try {
      opt.step();
      ADD_FAILURE() << "no error on rank " << c.rank();
    } catch (const std::invalid_argument& err) {
      EXPECT_NE(std::string(err.what()).find("'w'"), std::string::npos) << err.what();
    }
    EXPECT_TRUE(at::equal(p, before));
    EXPECT_TRUE(at::equal(opt.state(0)[0].second, q1));
    EXPECT_EQ(opt.step_count(0), 0);
    opt.set_grad(0, g);  // every rank with a gradient: the next step works
    opt.step();
    EXPECT_FALSE(at::equal(p, before));
  });
}

TEST(AdamW, NonFiniteGradientIsAnErrorAndTheStepIsNotTaken) {
  for (bool eight : {false, true}) {
    at::Tensor p = at::randn({100, 64}), g = at::randn({100, 64});
    std::vector<ParamShard> s{whole_param("w", p, g)};
    std::unique_ptr<AdamW> opt = eight ? std::make_unique<AdamW8bit>(s) : std::make_unique<AdamW>(s);
    opt->step();
    const at::Tensor p0 = p.clone(), m0 = opt->exp_avg(0).clone();
    g[7][3] = std::nan("");
    try {
      opt->step();
      FAIL() << "no error";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("'w'"), std::string::npos);
    }
    EXPECT_TRUE(at::equal(p, p0));
    EXPECT_TRUE(at::equal(opt->exp_avg(0), m0));
    EXPECT_EQ(opt->steps(), 1);
  }
}

}  // namespace
}  // namespace rfsdp

namespace rfsdp {
namespace {

// --- AdamW8bit's step element by element against a float64 transcription ---------

// The block of every element of a rows x row_len tensor (1-D blocks of the flattened
// tensor, or tiles numbered row-major over the tile grid), written independently of
// BlockLayout.
std::vector<int64_t> block_ids(int64_t rows, int64_t row_len, const quant::BlockShape& s) {
  std::vector<int64_t> ids(rows * row_len);
  const int64_t tiles_per_row = s.is_tile() ? (row_len + s.tile_cols - 1) / s.tile_cols : 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < row_len; ++c) {
      const int64_t e = r * row_len + c;
      ids[e] = s.is_tile() ? (r / s.tile_rows) * tiles_per_row + c / s.tile_cols : e / s.block;
    }
  }
  return ids;
}

TEST(AdamW8bit, StepEqualsFloat64TranscriptionElementByElement) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<std::pair<std::vector<int64_t>, quant::BlockShape>> cases = {
      {{37, 50}, quant::BlockShape::blocks(256)},
      {{300, 21}, quant::BlockShape::blocks(2048)},
      {{70, 45}, quant::BlockShape::tiles(32, 32)},
      {{5, 33}, quant::BlockShape::tiles(2, 8)}};
  const at::Tensor c1 = quant::dynamic_map(true), c2 = quant::dynamic_map(false);
  const std::vector<double> code1(c1.data_ptr<float>(), c1.data_ptr<float>() + 256);
  const std::vector<double> code2(c2.data_ptr<float>(), c2.data_ptr<float>() + 256);
  const auto lut1 = quant::code_lut(c1), lut2 = quant::code_lut(c2);
  const double lr = 3e-3, b1 = 0.9, b2 = 0.99, eps = 1e-8, wd = 0.1;
  testing::for_each_quant_isa([&](quant::cpu::Isa) {
  for (size_t c = 0; c < cases.size(); ++c) {
    const int64_t rows = cases[c].first[0], row_len = cases[c].first[1], n = rows * row_len;
    const quant::BlockLayout L(cases[c].second, rows, row_len);
    const std::vector<int64_t> ids = block_ids(rows, row_len, cases[c].second);
    at::Tensor p = seeded_randn({n}, seed, 10 * c);
    at::Tensor q1 = at::empty({n}, at::kByte), q2 = at::empty({n}, at::kByte);
    for (int64_t e = 0; e < n; ++e) {
      q1.data_ptr<uint8_t>()[e] = static_cast<uint8_t>(rng() % 256);
      q2.data_ptr<uint8_t>()[e] = static_cast<uint8_t>(rng() % 256);
    }
    at::Tensor a1 = seeded_randn({L.num_blocks}, seed, 10 * c + 1).abs() * 0.1;
    at::Tensor a2 = seeded_randn({L.num_blocks}, seed, 10 * c + 2).abs() * 0.01;
    for (int64_t step : {int64_t{1}, int64_t{7}}) {
      const at::Tensor g = seeded_randn({n}, seed, 10 * c + 3 + step);
      // float64: dequantise, AdamW, requantise per block.
      std::vector<double> m(n), v(n), pw(n), am1(L.num_blocks, 0.0), am2(L.num_blocks, 0.0);
      std::vector<double> mscale(n), vscale(n);  // size of the terms fp32 rounds (cancellation)
      std::vector<double> bm(L.num_blocks, 0.0), bv(L.num_blocks, 0.0);  // their block maxima
      const double bc1 = 1 - std::pow(b1, double(step)), bc2 = 1 - std::pow(b2, double(step));
      for (int64_t e = 0; e < n; ++e) {
        const double ge = g.data_ptr<float>()[e];
        const double m0 = code1[q1.data_ptr<uint8_t>()[e]] * a1.data_ptr<float>()[ids[e]];
        const double v0 = code2[q2.data_ptr<uint8_t>()[e]] * a2.data_ptr<float>()[ids[e]];
        m[e] = b1 * m0 + (1 - b1) * ge;
        v[e] = b2 * v0 + (1 - b2) * ge * ge;
        mscale[e] = std::fabs(b1 * m0) + std::fabs((1 - b1) * ge);
        vscale[e] = std::fabs(b2 * v0) + (1 - b2) * ge * ge;
        pw[e] = p.data_ptr<float>()[e] * (1 - lr * wd) -
                (lr / bc1) * m[e] / (std::sqrt(v[e]) / std::sqrt(bc2) + eps);
        am1[ids[e]] = std::max(am1[ids[e]], std::fabs(m[e]));
        am2[ids[e]] = std::max(am2[ids[e]], std::fabs(v[e]));
        bm[ids[e]] = std::max(bm[ids[e]], mscale[e]);
        bv[ids[e]] = std::max(bv[ids[e]], vscale[e]);
      }
      quant::cpu::adamw8bit_step(p.data_ptr<float>(), g.data_ptr<float>(), q1.data_ptr<uint8_t>(),
                                 a1.data_ptr<float>(), q2.data_ptr<uint8_t>(),
                                 a2.data_ptr<float>(), L, *lut1, *lut2,
                                 {float(lr), float(b1), float(b2), float(eps), float(wd), step});
      for (int64_t b = 0; b < L.num_blocks; ++b) {
        // fp32 rounds each moment's terms: where they cancel, the absmax's error is
        // relative to the terms (a few ulps of them), not to the absmax itself
        ASSERT_NEAR(a1.data_ptr<float>()[b], am1[b], 1e-5 * am1[b] + 1e-6 * bm[b])
            << "case " << c << " block " << b;
        ASSERT_NEAR(a2.data_ptr<float>()[b], am2[b], 1e-5 * am2[b] + 1e-6 * bv[b])
            << "case " << c << " block " << b;
      }
      for (int64_t e = 0; e < n; ++e) {
        ASSERT_NEAR(p.data_ptr<float>()[e], pw[e], 1e-6 + 1e-6 * std::fabs(pw[e]))
            << "case " << c << " element " << e;
        for (int moment = 0; moment < 2; ++moment) {
          const double amax = moment == 0 ? am1[ids[e]] : am2[ids[e]];
          const double x = amax > 0 ? (moment == 0 ? m[e] : v[e]) / amax : 0.0;
          // fp32's error in x: a few roundings of the terms, and of the absmax
          const double tol = amax > 0 ? 1e-6 * (moment == 0 ? mscale[e] : vscale[e]) / amax +
                                            1e-6 * std::fabs(x) + 1e-12
                                      : 1e-12;
          bool ambiguous = false;
          const int want = nearest_code(x, tol, moment == 0 ? code1 : code2, &ambiguous);
          const int got = moment == 0 ? q1.data_ptr<uint8_t>()[e] : q2.data_ptr<uint8_t>()[e];
          if (got != want) {
            // fp32 may round a value lying on a midpoint to the other neighbour
            ASSERT_TRUE(ambiguous && std::abs(got - want) == 1)
                << "case " << c << " element " << e << " moment " << moment << ": code " << got
                << ", float64 says " << want;
          }
        }
      }
    }
  }
  });
}

TEST(AdamW, ParametersAndGradientsOnOtherDevicesAreClearErrors) {
  ParamShard p = whole_param("w", at::zeros({4, 4}), at::Tensor(), 1);
  AdamW opt({p});
  try {
    opt.set_grad(0, at::zeros({4, 4}, at::kMeta));
    ADD_FAILURE() << "a gradient on another device was taken";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("on cpu (the parameter's device); got 16 Float elements "
                                         "on meta"),
              std::string::npos)
        << e.what();
  }
  try {
    AdamW bad({whole_param("m", at::zeros({4}, at::kMeta), at::Tensor(), 1)});
    ADD_FAILURE() << "a meta parameter was taken";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("on the CPU or a CUDA device"), std::string::npos)
        << e.what();
  }
}


TEST(AdamW8bit, ColumnPartsHoldGlobalBlocksAndEqualOneDeviceCodeForCode) {
  // Tensor parallelism's Shard(1) (RowwiseParallel) under FSDP's row chunks, 4
  // ranks: rank r holds part r % parts (of equal column blocks) and its rows
  // chunk[r]. Blocks that divide the part width lie whole in a part's row
  // segments, so each rank steps whole global blocks: its parameter equals the one
  // device's piece, and its codes and scales put in the global sequences by its
  // state_layout's runs (every rank's, the shared heads once) equal the one
  // device's state entry for entry. Tiles: rows [0, 3) + [3, 8) cut a row of 2 x 3
  // tiles, whose scale the two ranks agree.
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<std::pair<quant::BlockShape, std::vector<ColumnPartsMatrix>>> configs = {
      {quant::BlockShape::blocks(4),
       {{"proj", {6, 16}, 2, {{0, 3}, {0, 3}, {3, 6}, {3, 6}}},
        {"fc2", {5, 24}, 3, {{0, 5}, {0, 5}, {0, 5}, {0, 0}}}}},
      {quant::BlockShape::tiles(2, 3),
       {{"proj", {8, 12}, 2, {{0, 3}, {0, 3}, {3, 8}, {3, 8}}}}}};
  constexpr int kWorld = 4, kSteps = 3;
  AdamWOptions o;
  o.lr = 1e-2;
  for (const auto& [block, ms] : configs) {
    SCOPED_TRACE(block.str());
    std::vector<at::Tensor> wp, wg;
    std::vector<ParamShard> whole_shards;
    for (size_t i = 0; i < ms.size(); ++i) {
      wp.push_back(seeded_randn(ms[i].shape, seed, i));
      wg.push_back(at::zeros(ms[i].shape));
      whole_shards.push_back(whole_param(ms[i].name, wp.back(), wg.back()));
    }
    AdamW8bit whole(whole_shards, o, blocks8(block, 1));
    auto grad_of = [&](size_t i, int step) { return seeded_randn(ms[i].shape, seed, 100 + 10 * step + i); };
    auto piece = [&](const at::Tensor& full, size_t i, int r) { return ms[i].piece(full, r).contiguous(); };
    // [step][tensor][state k]: the global state put together from every rank's pieces.
    std::vector<std::vector<std::vector<at::Tensor>>> built(kSteps);
    for (int step = 0; step < kSteps; ++step) {
      for (size_t i = 0; i < ms.size(); ++i) {
        built[step].emplace_back();
        for (const auto& kv : whole.state(i)) {  // (-1: not written; codes and scales are >= 0)
          built[step][i].push_back(at::full({kv.second.numel()}, -1.0, at::kDouble));
        }
      }
    }
    std::mutex mu;
    std::map<int, std::string> failures;
    run_local_ranks(kWorld, [&](Comm& c) {
      const int r = c.rank();
      std::vector<ParamShard> shards;
      for (size_t i = 0; i < ms.size(); ++i) {
        ParamShard p(ms[i].shard(r), piece(seeded_randn(ms[i].shape, seed, i), i, r));
        p.grad = at::zeros_like(p.param);
        shards.push_back(p);
      }
      AdamW8bit opt(shards, o, blocks8(block, 1), std::shared_ptr<Comm>(&c, [](Comm*) {}));
      for (int step = 0; step < kSteps; ++step) {
        for (size_t i = 0; i < ms.size(); ++i) shards[i].grad.copy_(piece(grad_of(i, step), i, r));
        opt.step();
        for (size_t i = 0; i < ms.size(); ++i) {
          const auto st = opt.state(i);
          const auto layout = opt.state_layout(i);
          std::lock_guard<std::mutex> lock(mu);
          for (int k = 0; k < 4; ++k) {
            const StateLayout& l = *std::find_if(layout.begin(), layout.end(), [&](const StateLayout& x) {
              return x.name == st[k].first;
            });
            const at::Tensor mine = st[k].second.to(at::kDouble);
            auto runs = l.runs;
            if (runs.empty() && mine.numel()) runs = {{l.offset, mine.numel()}};
            int64_t pos = 0;
            for (const auto& [off, n] : runs) {
              for (int64_t e = 0; e < n; ++e, ++pos) {
                if (pos < l.shared) continue;  // an earlier rank writes it
                at::Tensor dst = built[step][i][k].narrow(0, off + e, 1);
                if (dst.item<double>() != -1.0) failures[r] += st[k].first + " written twice; ";
                dst.copy_(mine.narrow(0, pos, 1));
              }
            }
            if (pos != mine.numel()) failures[r] += st[k].first + ": runs miss elements; ";
            if (l.total != built[step][i][k].numel()) failures[r] += st[k].first + ": total; ";
          }
        }
      }
    });
    for (const auto& [r, msg] : failures) ADD_FAILURE() << "rank " << r << ": " << msg;
    for (int step = 0; step < kSteps; ++step) {
      for (size_t i = 0; i < ms.size(); ++i) wg[i].copy_(grad_of(i, step));
      whole.step();
      for (size_t i = 0; i < ms.size(); ++i) {
        const auto st = whole.state(i);
        for (int k = 0; k < 4; ++k) {
          EXPECT_TRUE(at::equal(built[step][i][k], st[k].second.to(at::kDouble)))
              << ms[i].name << " " << st[k].first << " step " << step;
        }
      }
    }
  }
}

TEST(AdamW8bit, ColumnPartsWhoseWidthCutsBlocksAreAClearError) {
  at::Tensor p = at::zeros({4, 6}), g = at::zeros({4, 6});
  ParamShard s(TensorShard::column_parts("proj", {4, 12}, 2, 0, 4), p, g);
  try {
    AdamW8bit opt({s}, {}, blocks8(quant::BlockShape::blocks(4), 1));
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    for (const char* want : {"'proj'", "2 column parts of 6 columns", "Shard(1)", "1-D blocks of 4",
                             "a block size that divides 6", "rfsdp.optim.AdamW"}) {
      EXPECT_NE(msg.find(want), std::string::npos) << want << " not in: " << msg;
    }
  }
}


TEST(AdamW8bit, ColumnPartsRequantiseASavedGlobalStateAsOneDevice) {
  // A checkpoint keeps codes and scales in the global order (the one device's);
  // loaded with other blocks into column parts (here one rank holding both parts
  // of a 6 x 16 matrix, 1-D blocks of 8 saved, 4 and 2 x 4 tiles loaded), each
  // state is the one device's requantised state at its layout's runs.
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<int64_t> shape = {6, 16};
  AdamWOptions o;
  o.lr = 1e-2;
  at::Tensor wp = seeded_randn(shape, seed, 0), wg = at::zeros(shape);
  AdamW8bit saved_opt({whole_param("w", wp, wg)}, o, blocks8(quant::BlockShape::blocks(8), 1));
  for (int step = 0; step < 2; ++step) {
    wg.copy_(seeded_randn(shape, seed, 10 + step));
    saved_opt.step();
  }
  NamedState full;
  for (const auto& kv : saved_opt.state(0)) full[kv.first] = kv.second.clone();
  const AdamW8bitConfig saved = blocks8(quant::BlockShape::blocks(8), 1);
  for (const quant::BlockShape& now : {quant::BlockShape::blocks(4), quant::BlockShape::tiles(2, 4)}) {
    SCOPED_TRACE(now.str());
    at::Tensor one = seeded_randn(shape, seed, 0);
    const AdamW8bit whole({whole_param("w", one, at::zeros(shape))}, o, blocks8(now, 1));
    const NamedState want = whole.requantized_state(0, saved, full);
    const at::Tensor parts_param = one.view({6, 2, 8}).permute({1, 0, 2}).reshape({12, 8}).contiguous();
    const AdamW8bit parts({ParamShard(TensorShard::column_parts("w", shape, 2, 0, 12, {{0, 12}}),
                                      parts_param, at::zeros_like(parts_param))},
                          o, blocks8(now, 1));
    const NamedState got = parts.requantized_state(0, saved, full);
    for (const StateLayout& l : parts.state_layout(0)) {
      ASSERT_TRUE(got.count(l.name)) << l.name;
      EXPECT_FALSE(l.runs.empty()) << l.name << ": its pieces were not put in the global order";
      EXPECT_TRUE(at::equal(got.at(l.name).reshape(-1),
                            piece_here(want.at(l.name), l, got.at(l.name).numel())))
          << l.name;
    }
  }
}

}  // namespace
}  // namespace rfsdp
