// SOAP on 1-4 thread ranks (planned with Shampoo's granule) against a float64
// single-device SOAP written here. A factor of rank below its size (a first
// gradient of a rectangular tile) has an arbitrary null-space basis, so the
// reference takes the first bases the optimizer computed (checked on their own:
// orthonormal, diagonalising the factor, descending) and follows the algorithm
// from there in float64: moments, rotated updates, bias correction, weight
// decay, factor updates, power-step refreshes with v's permutation.
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
#include <map>
#include <mutex>

#include "core/ragged/planner.h"
#include "optimizers/soap/soap.h"
#include "tests/cpp/test_util.h"
#include "tests/support/local_ranks.h"

namespace rfsdp {
namespace {

using testing::fresh_seed;
using testing::seeded_randn;

constexpr int64_t kB = 8;  // max_preconditioner_dim of these tests

struct Case {
  std::string name;
  std::vector<int64_t> shape;
  int row_dims;
  bool precondition;
};
// Square tiles, an expert stack, a matrix larger than B both ways and not a
// multiple of B (rectangular tiles), one with use_soap=False, a 1-D bias.
const std::vector<Case> kCases = {{"square", {16, 16}, 1, true},
                                  {"experts", {2, 8, 8}, 2, true},
                                  {"rect", {12, 20}, 1, true},
                                  {"plain", {6, 10}, 1, false},
                                  {"bias", {12}, 1, true}};

SOAPOptions options() {
  SOAPOptions o;
  o.lr = 0.01;
  o.beta1 = 0.9;
  o.beta2 = 0.95;
  o.shampoo_beta = 0.9;
  o.eps = 1e-8;
  o.weight_decay = 0.05;
  return o;
}

SOAPConfig config() {
  SOAPConfig c;
  c.max_preconditioner_dim = kB;
  c.precondition_frequency = 3;
  return c;
}

constexpr int kSteps = 9;

std::vector<at::Tensor> full_tensors(uint64_t seed, uint64_t stream) {
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < kCases.size(); ++i) {
    out.push_back(seeded_randn(kCases[i].shape, seed, stream * 10 + i));
  }
  return out;
}

// --- the float64 reference ---------------------------------------------------------

struct RefTile {
  int64_t off, rows, cols, stride;
  at::Tensor l, r, ql, qr;
};

at::Tensor view(const at::Tensor& flat, const RefTile& t) {
  return flat.as_strided({t.rows, t.cols}, {t.stride, 1}, t.off);
}

struct RefSOAP {
  SOAPOptions o;
  SOAPConfig c;
  std::vector<at::Tensor> x, m, v;
  std::vector<std::vector<RefTile>> tiles;
  int64_t t = 0;

  explicit RefSOAP(const std::vector<at::Tensor>& init) : o(options()), c(config()) {
    for (size_t i = 0; i < kCases.size(); ++i) {
      x.push_back(init[i].to(at::kDouble).reshape(-1).clone());
      m.push_back(at::zeros_like(x.back()));
      v.push_back(at::zeros_like(x.back()));
      std::vector<RefTile> ts;
      const auto& s = kCases[i].shape;
      if (kCases[i].precondition && s.size() >= 2) {
        const int64_t mats = s.size() == 3 ? s[0] : 1, h = s.size() == 3 ? s[1] : s[0];
        const int64_t w = x.back().numel() / (mats * h);
        for (int64_t e = 0; e < mats; ++e) {
          for (int64_t r0 = 0; r0 < h; r0 += kB) {
            for (int64_t c0 = 0; c0 < w; c0 += kB) {
              RefTile tl;
              tl.off = e * h * w + r0 * w + c0;
              tl.rows = std::min(kB, h - r0);
              tl.cols = std::min(kB, w - c0);
              tl.stride = w;
              tl.l = at::zeros({tl.rows, tl.rows}, at::kDouble);
              tl.r = at::zeros({tl.cols, tl.cols}, at::kDouble);
              ts.push_back(tl);
            }
          }
        }
      }
      tiles.push_back(ts);
    }
  }

  // One power step and QR of side X with basis q; permutes v's `dim` alike.
  static at::Tensor refresh(const at::Tensor& x, const at::Tensor& q, at::Tensor vt, int dim) {
    const at::Tensor est = at::mm(q.t(), at::mm(x, q)).diagonal();
    const at::Tensor order = at::argsort(est, true, 0, true);
    vt.copy_(vt.index_select(dim, order));
    return std::get<0>(at::linalg_qr(at::mm(x, q.index_select(1, order))));
  }

  // bases[i]: case i's first bases (Q_L, Q_R per tile, in tile order), used at t = 1.
  void step(const std::vector<at::Tensor>& grads,
            const std::vector<std::vector<std::pair<at::Tensor, at::Tensor>>>& bases) {
    ++t;
    const double bs = o.shampoo_beta;
    for (size_t i = 0; i < x.size(); ++i) {
      const at::Tensor g = grads[i].to(at::kDouble).reshape(-1);
      auto& ts = tiles[i];
      if (t == 1) {
        for (size_t k = 0; k < ts.size(); ++k) {
          const at::Tensor gt = view(g, ts[k]);
          ts[k].l = (1 - bs) * at::mm(gt, gt.t());
          ts[k].r = (1 - bs) * at::mm(gt.t(), gt);
          ts[k].ql = bases[i][k].first.to(at::kDouble);
          ts[k].qr = bases[i][k].second.to(at::kDouble);
        }
        continue;
      }
      const int64_t s = t - 1;
      m[i] = o.beta1 * m[i] + (1 - o.beta1) * g;
      at::Tensor n = at::zeros_like(g);
      if (ts.empty()) {
        v[i] = o.beta2 * v[i] + (1 - o.beta2) * g * g;
        n = m[i] / (v[i].sqrt() + o.eps);
      }
      for (auto& tl : ts) {
        const at::Tensor gp = at::mm(at::mm(tl.ql.t(), view(g, tl)), tl.qr);
        at::Tensor vt = view(v[i], tl);
        vt.copy_(o.beta2 * vt + (1 - o.beta2) * gp * gp);
        const at::Tensor mp = at::mm(at::mm(tl.ql.t(), view(m[i], tl)), tl.qr);
        view(n, tl).copy_(at::mm(at::mm(tl.ql, mp / (vt.sqrt() + o.eps)), tl.qr.t()));
      }
      const double step = o.lr * std::sqrt(1 - std::pow(o.beta2, s)) / (1 - std::pow(o.beta1, s));
      x[i] = (x[i] - step * n) * (1 - o.lr * o.weight_decay);
      for (auto& tl : ts) {
        const at::Tensor gt = view(g, tl);
        tl.l = bs * tl.l + (1 - bs) * at::mm(gt, gt.t());
        tl.r = bs * tl.r + (1 - bs) * at::mm(gt.t(), gt);
        if (s % c.precondition_frequency == 0) {
          tl.ql = refresh(tl.l, tl.ql, view(v[i], tl), 0);
          tl.qr = refresh(tl.r, tl.qr, view(v[i], tl), 1);
        }
      }
    }
  }
};

// --- the sharded runs -----------------------------------------------------------------

ParamShard shard_of(const Plan& plan, size_t i, int rank, const at::Tensor& full) {
  const TensorSpec& t = plan.tensors[i];
  const ShardRange r = plan.shard(i, rank);
  return ParamShard(TensorShard::of_plan(plan, i, rank),
                    full.reshape(-1).narrow(0, r.row_begin * t.row_elems(), r.numel).clone());
}

struct SoapRun {
  std::vector<at::Tensor> params;  // full, flat
  // Per case, per tile (tile order): the first bases; and the first factors' L, R.
  std::vector<std::vector<std::pair<at::Tensor, at::Tensor>>> bases;
};

SoapRun run_sharded(int world, uint64_t seed) {
  std::vector<TensorSpec> specs;
  for (const Case& c : kCases) {
    TensorSpec t;
    t.name = c.name;
    t.shape = c.shape;
    t.row_dims = c.row_dims;
    t.granule_rows = shampoo_granule_rows(c.shape, c.row_dims, kB);
    specs.push_back(t);
  }
  const Plan plan = plan_unit(specs, world, 16);
  const std::vector<at::Tensor> init = full_tensors(seed, 0);
  SoapRun run;
  run.params.resize(kCases.size());
  for (size_t i = 0; i < kCases.size(); ++i) run.params[i] = at::zeros({init[i].numel()});
  std::vector<std::vector<std::vector<std::pair<at::Tensor, at::Tensor>>>> by_rank(world);
  std::mutex mu;
  run_local_ranks(world, [&](Comm& comm) {
    const int rank = comm.rank();
    std::vector<ParamShard> shards;
    std::vector<bool> pre;
    for (size_t i = 0; i < kCases.size(); ++i) {
      shards.push_back(shard_of(plan, i, rank, init[i]));
      pre.push_back(kCases[i].precondition);
    }
    SOAP opt(shards, options(), config(), std::shared_ptr<Comm>(&comm, [](Comm*) {}), pre);
    for (int s = 0; s < kSteps; ++s) {
      const auto g = full_tensors(seed, s + 1);
      for (size_t i = 0; i < kCases.size(); ++i) opt.set_grad(i, shard_of(plan, i, rank, g[i]).param);
      opt.step();
      if (s == 0) {  // this rank's first bases, tile by tile
        std::vector<std::vector<std::pair<at::Tensor, at::Tensor>>> mine(kCases.size());
        int64_t ql = 0, qr = 0;
        size_t last = SIZE_MAX;
        for (const ShampooTile& t : opt.tiles()) {
          if (t.param != last) ql = qr = 0, last = t.param;
          const auto st = opt.state(t.param);
          const at::Tensor bl = st[4].second, br = st[5].second;
          mine[t.param].push_back({bl.narrow(0, ql, t.rows * t.rows).view({t.rows, t.rows}).clone(),
                                   br.narrow(0, qr, t.cols * t.cols).view({t.cols, t.cols}).clone()});
          ql += t.rows * t.rows;
          qr += t.cols * t.cols;
        }
        std::lock_guard<std::mutex> lock(mu);
        by_rank[rank] = mine;
      }
    }
    std::lock_guard<std::mutex> lock(mu);
    for (size_t i = 0; i < kCases.size(); ++i) {
      const ParamShard& p = opt.params()[i];
      run.params[i].narrow(0, p.row_begin * p.row_len, p.param.numel()).copy_(p.param);
    }
  });
  run.bases.resize(kCases.size());
  for (int r = 0; r < world; ++r) {  // tiles are whole on one rank, in tile order by rank
    for (size_t i = 0; i < kCases.size(); ++i) {
      for (const auto& b : by_rank[r][i]) run.bases[i].push_back(b);
    }
  }
  return run;
}

class SOAPRanks : public ::testing::TestWithParam<int> {};

TEST_P(SOAPRanks, ShardsEqualTheFloat64SingleDeviceSOAP) {
  const int world = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const SoapRun run = run_sharded(world, seed);
  RefSOAP ref(full_tensors(seed, 0));
  // The first bases: orthonormal, diagonalising the first factor, descending.
  for (size_t i = 0; i < kCases.size(); ++i) {
    ASSERT_EQ(run.bases[i].size(), ref.tiles[i].size()) << kCases[i].name;
    const at::Tensor g = full_tensors(seed, 1)[i].to(at::kDouble).reshape(-1);
    for (size_t k = 0; k < ref.tiles[i].size(); ++k) {
      const at::Tensor gt = view(g, ref.tiles[i][k]);
      for (bool left : {true, false}) {
        const at::Tensor q = (left ? run.bases[i][k].first : run.bases[i][k].second).to(at::kDouble);
        const at::Tensor f = left ? at::mm(gt, gt.t()) : at::mm(gt.t(), gt);
        const int64_t n = q.size(0);
        EXPECT_LT((at::mm(q.t(), q) - at::eye(n, at::kDouble)).abs().max().item<double>(), 1e-5);
        const at::Tensor d = at::mm(q.t(), at::mm(f, q));
        const double scale = f.abs().max().item<double>();
        EXPECT_LT((d - at::diag(d.diagonal())).abs().max().item<double>(), 1e-5 * scale)
            << kCases[i].name << " tile " << k;
        const at::Tensor dd = d.diagonal();
        for (int64_t j = 1; j < n; ++j) {
          EXPECT_GE(dd[j - 1].item<double>(), dd[j].item<double>() - 1e-5 * scale);
        }
      }
    }
  }
  for (int s = 0; s < kSteps; ++s) ref.step(full_tensors(seed, s + 1), run.bases);
  const std::vector<at::Tensor> init = full_tensors(seed, 0);
  for (size_t i = 0; i < kCases.size(); ++i) {
    const at::Tensor x0 = init[i].to(at::kDouble).reshape(-1);
    const at::Tensor moved = (ref.x[i] - x0).abs().max();
    const double err = (run.params[i].to(at::kDouble) - ref.x[i]).abs().max().item<double>();
    // fp32 rounding of rotations and a division by sqrt(v): within 1e-4 of the
    // largest displacement (measured: up to 1.3e-5 of it).
    EXPECT_LT(err, 1e-4 * moved.item<double>()) << kCases[i].name << ": max error " << err
                                                << " of a displacement " << moved.item<double>();
    EXPECT_GT(moved.item<double>(), 0) << kCases[i].name;
    std::cout << "[ figure ] " << world << " ranks, " << kCases[i].name << ": max error "
              << err / moved.item<double>() << " of the largest displacement\n";
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, SOAPRanks, ::testing::Values(1, 2, 3, 4));

TEST(SOAP, FirstStepOnlyBuildsTheBasesAndBadSettingsAreClearErrors) {
  at::Tensor p = at::randn({8, 8}), b = at::randn({8});
  const at::Tensor p0 = p.clone(), b0 = b.clone();
  SOAP opt({whole_param("w", p, at::randn({8, 8})), whole_param("b", b, at::randn({8}))},
           options(), config());
  opt.step();
  EXPECT_TRUE(at::equal(p, p0));  // t = 1: no update, 1-D parameters included
  EXPECT_TRUE(at::equal(b, b0));
  EXPECT_TRUE(at::equal(opt.state(0)[0].second, at::zeros({8, 8})));  // m untouched
  opt.step();
  EXPECT_FALSE(at::equal(p, p0));
  EXPECT_FALSE(at::equal(b, b0));
  SOAPOptions bad = options();
  bad.beta2 = 1.0;
  EXPECT_THROW(SOAP({whole_param("w", p, {})}, bad, config()), std::invalid_argument);
  SOAPConfig c = config();
  c.precondition_frequency = 0;
  EXPECT_THROW(SOAP({whole_param("w", p, {})}, options(), c), std::invalid_argument);
  // A shard that cuts a tile (without every rank's rows) is refused by name.
  ParamShard cut(TensorShard::rows_of("w", {20, 8}, 1, 4, 20), at::zeros({16 * 8}));
  try {
    SOAP s({cut}, options(), config());
    ADD_FAILURE() << "a cut tile was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'w'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace rfsdp
