// Shampoo on 1-4 thread ranks against a float64 single-device Shampoo written
// here (same tiling), the tiling and its granule, the inverse roots against
// float64 eigh, the fp64 retry and the three-failures error.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <random>

#include "tests/support/local_ranks.h"
#include "core/ragged/planner.h"
#include "optimizers/shampoo/shampoo.h"
#include "quant/ops.h"
#include "tests/cpp/column_parts_test_util.h"
#include "tests/cpp/test_util.h"
#include "tests/cpp/tiled_test_util.h"

namespace rfsdp {
namespace {

using testing::CodeCheck;
using testing::expect_block_codes;
using testing::ColumnPartsMatrix;
using testing::fresh_seed;
using testing::LowbitSquare;
using testing::lowbit_square;
using testing::seeded_randn;
using testing::Case;
using testing::RefTile;
using testing::ref_tiles;
using testing::ref_view;
using testing::shard_of;

constexpr int64_t kB = 8;  // max_preconditioner_dim of these tests

// Larger than B both ways, not a multiple of B, an expert stack whose H is not a
// multiple of B, a 1-D bias.
const std::vector<Case> kCases = {{"big", {20, 19}, 1},
                                  {"odd", {13, 8}, 1},
                                  {"experts", {3, 10, 6}, 2},
                                  {"bias", {12}, 1}};

// --- the float64 reference: whole tensors, one device ------------------------

at::Tensor ref_root(const at::Tensor& a) {
  auto [lam, q] = at::linalg_eigh(a);
  return at::matmul(q * lam.pow(-0.25).unsqueeze(0), q.t());
}

// The float64 reference of a rule (RankDeficient) on A, eigenvalue by eigenvalue:
// Shift lifts the spectrum to a smallest eigenvalue of eps where it is below;
// PseudoInverse keeps eigenvalues above rtol * the largest (root 0 elsewhere);
// Strict keeps them all.
at::Tensor ref_root_rule(const at::Tensor& a, RankDeficient mode, double eps, double rtol) {
  auto [lam, q] = at::linalg_eigh(a.to(at::kDouble));
  const int64_t n = lam.size(0);
  std::vector<double> l(n);
  for (int64_t k = 0; k < n; ++k) l[k] = lam[k].item<double>();
  const double lo = *std::min_element(l.begin(), l.end());
  const double hi = *std::max_element(l.begin(), l.end());
  at::Tensor s = at::zeros({n}, at::kDouble);
  for (int64_t k = 0; k < n; ++k) {
    double x = l[k];
    if (mode == RankDeficient::Shift && lo < eps) x = x - lo + eps;
    if (mode == RankDeficient::PseudoInverse && !(x > rtol * hi)) continue;
    s[k] = std::pow(x, -0.25);
  }
  return at::matmul(q * s.unsqueeze(0), q.t());
}

struct RefShampoo {
  ShampooOptions o;
  ShampooConfig c;  // its rank_deficient rule and rank_rtol (>= 0) are followed
  std::vector<at::Tensor> x, m, v;
  std::vector<std::vector<RefTile>> tiles;
  int64_t t = 0;

  RefShampoo(const std::vector<at::Tensor>& init, ShampooOptions o_, ShampooConfig c_)
      : o(o_), c(c_) {
    for (size_t i = 0; i < init.size(); ++i) {  // (kCases', or any matrices)
      x.push_back(init[i].to(at::kDouble).reshape(-1).clone());
      m.push_back(at::zeros_like(x.back()));
      v.push_back(at::zeros_like(x.back()));
      std::vector<RefTile> ts = ref_tiles(init[i].sizes().vec(), c.max_preconditioner_dim);
      tiles.push_back(ts);
    }
  }

  void step(const std::vector<at::Tensor>& grads) {
    ++t;
    for (size_t i = 0; i < x.size(); ++i) {
      const at::Tensor g = grads[i].to(at::kDouble).reshape(-1);
      v[i] = o.grafting_beta2 * v[i] + (1 - o.grafting_beta2) * g * g;
      m[i] = o.beta1 * m[i] + (1 - o.beta1) * g;
      const at::Tensor mh = m[i] / (1 - std::pow(o.beta1, t));
      at::Tensor u = mh / ((v[i] / (1 - std::pow(o.grafting_beta2, t))).sqrt() + o.grafting_epsilon);
      for (auto& tl : tiles[i]) {
        const at::Tensor gt = ref_view(g, tl);
        tl.l = o.beta2 * tl.l + (1 - o.beta2) * at::matmul(gt, gt.t());
        tl.r = o.beta2 * tl.r + (1 - o.beta2) * at::matmul(gt.t(), gt);
        if (t % c.precondition_frequency == 0) {
          const double bc = 1 - std::pow(o.beta2, t);
          tl.left = ref_root_rule(tl.l / bc + o.epsilon * at::eye(tl.rows, at::kDouble),
                                c.rank_deficient, o.epsilon, c.rank_rtol);
          tl.right = ref_root_rule(tl.r / bc + o.epsilon * at::eye(tl.cols, at::kDouble),
                                c.rank_deficient, o.epsilon, c.rank_rtol);
        }
        if (t >= c.start_preconditioning_step) {
          at::Tensor d = ref_view(u, tl);
          const at::Tensor p = at::matmul(at::matmul(tl.left, ref_view(mh, tl)), tl.right);
          if (p.norm().item<double>() > 0) d.copy_(p * (d.norm() / p.norm()));  // else D
        }
      }
      x[i] = x[i] * (1 - o.lr * o.weight_decay) - o.lr * u;
    }
  }
};

// --- the tiles and the granule --------------------------------------------------

std::vector<TensorSpec> unit_specs(int64_t max_dim) {
  std::vector<TensorSpec> specs;
  for (const auto& c : kCases) {
    TensorSpec t;
    t.name = c.name;
    t.shape = c.shape;
    t.row_dims = c.row_dims;
    t.granule_rows = tile_granule_rows(c.shape, c.row_dims, max_dim);
    specs.push_back(t);
  }
  return specs;
}

TEST(Tiles, TheGranuleKeepsEveryTileOnOneRank) {
  for (int64_t world : {1, 2, 3, 4, 7}) {
    const Plan plan = plan_unit(unit_specs(kB), world, 16);
    for (size_t i = 0; i < plan.tensors.size(); ++i) {
      const at::Tensor full = at::zeros(plan.tensors[i].shape);
      int64_t covered = 0;
      for (int r = 0; r < world; ++r) {
        const ParamShard p = shard_of(plan, i, r, full);
        if (p.shape.size() < 2) continue;
        for (const Tile& t : matrix_tiles("Shampoo", p, i, kB)) {  // throws if a tile is cut
          covered += t.rows * t.cols;
          ASSERT_LE(t.rows, kB);
          ASSERT_LE(t.cols, kB);
          ASSERT_GE(t.local_offset, 0);
          ASSERT_LE(t.local_offset + (t.rows - 1) * t.stride + t.cols, p.param.numel());
          if (p.shape.size() == 3) ASSERT_LE(t.row0 + t.rows, p.shape[1]);  // inside an expert
        }
      }
      if (plan.tensors[i].shape.size() >= 2) EXPECT_EQ(covered, full.numel()) << plan.tensors[i].name;
    }
  }
  // A shard that cuts a tile is refused by name.
  ParamShard p(TensorShard::rows_of("w", {20, 19}, 1, 4, 20), at::zeros({16 * 19}));
  try {
    matrix_tiles("Shampoo", p, 0, kB);
    ADD_FAILURE() << "a cut tile was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("parameter 'w'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rfsdp.policy.shampoo"), std::string::npos) << e.what();
    // rows [4, 20): tiles of 4 rows are whole (what FSDP2 users can choose)
    EXPECT_NE(std::string(e.what()).find("max_preconditioner_dim=4 divides"), std::string::npos)
        << e.what();
  }
  try {  // SOAP: its own name, and every rank's rows as the way to share cut tiles
    matrix_tiles("SOAP", p, 0, kB);
    ADD_FAILURE() << "a cut tile was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()).rfind("SOAP: parameter 'w'", 0), 0u) << e.what();
    EXPECT_NE(std::string(e.what()).find("every rank's rows"), std::string::npos) << e.what();
  }
  EXPECT_EQ(tile_granule_rows({3, 10, 6}, 2, kB), 10);  // H not a multiple of B: whole experts
  EXPECT_EQ(tile_granule_rows({3, 16, 6}, 2, kB), kB);
  EXPECT_EQ(tile_granule_rows({20, 19}, 1, kB), kB);
  EXPECT_EQ(tile_granule_rows({12}, 1, kB), 1);
}

// A checkpoint's per-tile sequence: each rank's piece (tile_range, tile_sequence)
// starts where the ranks before it end and holds exactly the tiles the rank keeps
// (matrix_tiles: whole ones and the cut rows it owns), so the pieces of every
// rank, in rank order, tile the sequence of the whole tensor; on a plan's shards
// and on FSDP2's chunk rows that cut tiles, at 1..7 ranks.
TEST(Tiles, EachRanksPieceOfAPerTileSequenceFollowsTheRanksBeforeIt) {
  const auto packed_rows = [](const Tile& t) { return packed_size(t.rows); };
  for (int world : {1, 2, 3, 4, 7}) {
    const Plan plan = plan_unit(unit_specs(kB), world, 16);
    for (size_t i = 0; i < kCases.size(); ++i) {
      if (kCases[i].shape.size() < 2) continue;
      const at::Tensor full = at::zeros(kCases[i].shape);
      for (bool chunks : {false, true}) {
        int64_t next = 0, total = -1;
        for (int r = 0; r < world; ++r) {
          const ParamShard p = chunks ? chunk_shard_of(kCases[i], world, r, full)
                                      : shard_of(plan, i, r, full);
          std::vector<CutTileRow> cut;
          const auto kept = matrix_tiles("Shampoo", p, i, kB, r, &cut);
          const TileRange range = tile_range(p, kB);
          const StateLayout l = tile_sequence("factor_left", range, packed_rows);
          int64_t mine = 0;
          for (const Tile& t : kept) mine += packed_size(t.rows);
          int64_t in_range = 0;
          for (size_t k = range.first; k < range.end; ++k) in_range += packed_size(range.all[k].rows);
          ASSERT_EQ(in_range, mine) << kCases[i].name << " rank " << r << " of " << world;
          ASSERT_EQ(range.end - range.first, kept.size());
          ASSERT_EQ(l.offset, next) << kCases[i].name << " rank " << r << " of " << world;
          ASSERT_TRUE(total < 0 || l.total == total);
          total = l.total;
          next += mine;
        }
        int64_t whole = 0;
        for (const RefTile& t : ref_tiles(kCases[i].shape, kB)) whole += packed_size(t.rows);
        EXPECT_EQ(next, whole) << kCases[i].name;
        EXPECT_EQ(total, whole) << kCases[i].name;
      }
    }
  }
}

// --- roots -----------------------------------------------------------------------

TEST(ShampooRoots, EqualFloat64EighBatchedAndAlone) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::vector<at::Tensor> a;
  for (int k = 0; k < 5; ++k) {
    const at::Tensor g = seeded_randn({6, 9}, seed, k, at::kDouble);
    a.push_back(at::matmul(g, g.t()) / 9 + 1e-3 * at::eye(6, at::kDouble));
  }
  std::vector<at::Tensor> a32;
  for (const auto& x : a) a32.push_back(x.to(at::kFloat));
  std::vector<bool> ok;
  int64_t retries = 0;
  const auto roots = inverse_fourth_roots(a32, &ok, &retries);
  for (size_t k = 0; k < a.size(); ++k) {
    ASSERT_TRUE(ok[k]);
    const at::Tensor want = ref_root(a32[k].to(at::kDouble));
    EXPECT_TRUE(at::allclose(roots[k].to(at::kDouble), want, 1e-4, 1e-4)) << "matrix " << k;
    // and it is a root: (A^-1/4)^4 A = I
    const at::Tensor r = roots[k].to(at::kDouble);
    const at::Tensor id = at::matmul(at::matmul(at::matmul(at::matmul(r, r), r), r), a32[k].to(at::kDouble));
    EXPECT_TRUE(at::allclose(id, at::eye(6, at::kDouble), 1e-3, 1e-3)) << "matrix " << k;
  }
  EXPECT_EQ(retries, 0);
  // NaN (on the diagonal: eigh reads one triangle): both precisions fail.
  at::Tensor bad = a32[0].clone();
  bad[1][1] = std::nan("");
  inverse_fourth_roots({a32[1], bad}, &ok, &retries);
  EXPECT_TRUE(ok[0]);
  EXPECT_FALSE(ok[1]);
  EXPECT_EQ(retries, 1);
}

TEST(ShampooRoots, Fp32FailureIsRetriedInFp64) {
  // A float32 matrix whose float32 eigendecomposition gives a non-positive
  // eigenvalue while float64's are all positive: found by search, each candidate
  // checked with both precisions here.
  std::mt19937_64 rng(12345);
  for (int tries = 0; tries < 2000; ++tries) {
    const at::Tensor q = std::get<0>(at::linalg_qr(at::randn({4, 4}, at::kDouble)));
    const at::Tensor lam = at::tensor({1.0, 0.5, 0.25, 3e-8}, at::kDouble);
    const at::Tensor a32 = at::matmul(q * lam.unsqueeze(0), q.t()).to(at::kFloat);
    const at::Tensor sym = (a32 + a32.t()) / 2;
    const double min32 = std::get<0>(at::linalg_eigh(sym)).min().item<double>();
    const double min64 = std::get<0>(at::linalg_eigh(sym.to(at::kDouble))).min().item<double>();
    if (!(min32 <= 0 && min64 > 0)) continue;
    std::vector<bool> ok;
    int64_t retries = 0;
    const auto roots = inverse_fourth_roots({sym}, &ok, &retries);
    ASSERT_TRUE(ok[0]);
    EXPECT_EQ(retries, 1);
    EXPECT_TRUE(at::allclose(roots[0].to(at::kDouble), ref_root(sym.to(at::kDouble)), 1e-4, 1e-2));
    return;
  }
  FAIL() << "no matrix found whose float32 eigh fails and float64's does not";
}

TEST(ShampooRoots, FloorShiftsAnIndefiniteMatrixInsteadOfFailing) {
  // An indefinite symmetric matrix (as a bf16-rounded factor is): without a floor
  // both precisions fail; with floor f every eigenvalue l becomes l - l_min + f.
  const uint64_t seed = fresh_seed();
  const at::Tensor q = std::get<0>(at::linalg_qr(seeded_randn({5, 5}, seed, 0, at::kDouble)));
  const at::Tensor lam = at::tensor({2.0, 1.0, 0.3, 1e-3, -4e-3}, at::kDouble);
  const at::Tensor a = at::matmul(q * lam.unsqueeze(0), q.t());
  const at::Tensor a32 = ((a + a.t()) / 2).to(at::kFloat);
  std::vector<bool> ok;
  int64_t retries = 0;
  inverse_fourth_roots({a32}, &ok, &retries);
  EXPECT_FALSE(ok[0]);
  const double floor = 1e-4;
  const auto roots = inverse_fourth_roots({a32, a32}, &ok, &retries,
                                          {RankDeficient::Shift, {floor, 10.0}});
  const at::Tensor x = a32.to(at::kDouble);
  const double lo = std::get<0>(at::linalg_eigh(x)).min().item<double>();
  const at::Tensor id = at::eye(5, at::kDouble);
  for (int k = 0; k < 2; ++k) {
    ASSERT_TRUE(ok[k]) << "seed " << seed;
    const double f = k == 0 ? floor : 10.0;
    const at::Tensor want = ref_root(x + (f - lo) * id);
    EXPECT_TRUE(at::allclose(roots[k].to(at::kDouble), want, 1e-3, 1e-3))
        << "seed " << seed << " floor " << f << ": max diff "
        << (roots[k].to(at::kDouble) - want).abs().max().item<double>();
  }
  // A positive definite matrix above the floor is left as it is.
  const at::Tensor pd = (a32 + (0.01 - lo) * at::eye(5)).contiguous();
  const auto same = inverse_fourth_roots({pd}, &ok, &retries, {RankDeficient::Shift, {1e-6}});
  ASSERT_TRUE(ok[0]);
  EXPECT_TRUE(at::allclose(same[0].to(at::kDouble), ref_root(pd.to(at::kDouble)), 1e-4, 1e-4));
  EXPECT_THROW(inverse_fourth_roots({pd}, &ok, &retries, {RankDeficient::Shift, {1e-6, 1e-6}}),
               std::invalid_argument);
}

// A rank-deficient factor as Shampoo makes it: L = G G^T of a rank-r gradient
// (n x cols) computed in float32, some rows zero; the float32 rounding of the
// product leaves its n - r zero eigenvalues slightly positive or negative.
at::Tensor deficient_factor(int64_t n, int64_t r, int64_t cols, int64_t zero_rows, uint64_t seed) {
  at::Tensor g = at::matmul(seeded_randn({n, r}, seed, 1, at::kDouble),
                            seeded_randn({r, cols}, seed, 2, at::kDouble))
                     .to(at::kFloat);
  g.narrow(0, 0, zero_rows).zero_();
  return at::mm(g, g.t()) / static_cast<double>(cols);
}

// The largest |x - want| over the largest |want|.
double rel_error(const at::Tensor& x, const at::Tensor& want) {
  return (x.to(at::kDouble) - want).abs().max().item<double>() / want.abs().max().item<double>();
}

TEST(ShampooRoots, RankDeficientFactorsUnderEachRuleEqualTheirFloat64Reference) {
  // Rank 5 of 12 with 3 zero rows, eps large enough that rounding (about 1e-7 of
  // the largest eigenvalue) cannot move which eigenvalues a rule shifts or drops.
  // Scaled to a largest eigenvalue of 1 so that holds for every seed: unscaled it
  // is ~30, and fp32's error in the eigenvalues at eps (~1e-7 x 30 / 1e-3) moved
  // their roots by up to 1.9e-3 of the largest (1-2 % of seeds failed 1e-3).
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const at::Tensor l0 = deficient_factor(12, 5, 30, 3, seed);
  const at::Tensor l = l0 / std::get<0>(at::linalg_eigh(l0.to(at::kDouble))).max().item<double>();
  std::vector<bool> ok;
  for (double eps : {1e-3, 0.0}) {
    const at::Tensor a = (l + eps * at::eye(12)).contiguous();
    // Shift (eps > 0 only) and PseudoInverse, against float64 on the same float32 matrix.
    if (eps > 0) {
      const auto r = inverse_fourth_roots({a}, &ok, nullptr, {RankDeficient::Shift, {eps}});
      ASSERT_TRUE(ok[0]);
      EXPECT_LT(rel_error(r[0], ref_root_rule(a, RankDeficient::Shift, eps, 0)), 1e-3);
    }
    const double rtol = 12 * 1.1920929e-7;  // the default: n * eps(float32)
    const auto p = inverse_fourth_roots({a}, &ok, nullptr, {RankDeficient::PseudoInverse, {}, -1});
    ASSERT_TRUE(ok[0]);
    const at::Tensor want = ref_root_rule(a, RankDeficient::PseudoInverse, eps, rtol);
    EXPECT_LT(rel_error(p[0], want), 1e-3) << "eps " << eps;
    // The zero rows' directions: no preconditioning (eps = 0) or eps^-1/4 (eps > 0).
    const at::Tensor corner = p[0].narrow(0, 0, 3).narrow(1, 0, 3).to(at::kDouble);
    const at::Tensor id = eps > 0 ? std::pow(eps, -0.25) * at::eye(3, at::kDouble)
                                  : at::zeros({3, 3}, at::kDouble);
    EXPECT_LT((corner - id).abs().max().item<double>(), 1e-3 * want.abs().max().item<double>());
  }
  // Strict: eps keeps it positive definite: fine; eps = 0: its zero eigenvalues fail.
  inverse_fourth_roots({(l + 1e-3 * at::eye(12)).contiguous()}, &ok, nullptr, {});
  EXPECT_TRUE(ok[0]);
  int64_t retries = 0;
  inverse_fourth_roots({l}, &ok, &retries, {});
  EXPECT_FALSE(ok[0]);
  EXPECT_EQ(retries, 1);
}

TEST(ShampooRoots, AFactorMadeIndefiniteByFloat32RoundingFailsStrictlyButNotUnderShiftOrPseudoInverse) {
  // What the main job met on AMD EPYC: a 64 x 64 factor of rank 8 whose float32
  // product left eigenvalues below zero (about -1e-8 of the largest), with the
  // main job's eps = 1e-10. The matrix itself is indefinite (float64 sees it too),
  // so the old code, which failed on any eigenvalue <= 0 in fp32 and then fp64
  // (Strict), fails on it on any CPU.
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const double eps = 1e-10;
  const at::Tensor a = (deficient_factor(64, 8, 64, 0, seed) + eps * at::eye(64)).contiguous();
  const at::Tensor lam64 = std::get<0>(at::linalg_eigh(a.to(at::kDouble)));
  const double lmax = lam64.max().item<double>();
  ASSERT_LT(lam64.min().item<double>(), -1e-9 * lmax) << "the rounding left it positive definite";
  std::vector<bool> ok;
  int64_t retries = 0;
  inverse_fourth_roots({a}, &ok, &retries, {});
  EXPECT_FALSE(ok[0]) << "strict accepted an indefinite factor";
  EXPECT_EQ(retries, 1);
  // Shift: finite and positive definite; on the factor's range (eigenvalues well
  // above the rounding) it equals the float64 reference.
  const auto r = inverse_fourth_roots({a}, &ok, nullptr, {RankDeficient::Shift, {eps}});
  ASSERT_TRUE(ok[0]);
  const at::Tensor r64 = r[0].to(at::kDouble);
  EXPECT_GT(std::get<0>(at::linalg_eigh(r64)).min().item<double>(), 0);
  auto [lam, q] = at::linalg_eigh(a.to(at::kDouble));
  const at::Tensor range = q.index({at::indexing::Slice(), lam > 1e-4 * lmax});
  ASSERT_EQ(range.size(1), 8);
  const at::Tensor want = ref_root_rule(a, RankDeficient::Shift, eps, 0);
  const at::Tensor on_range = at::matmul(at::matmul(range.t(), r64), range);
  EXPECT_LT(rel_error(on_range, at::matmul(at::matmul(range.t(), want), range)), 1e-3);
  // PseudoInverse: the reference's eigenvalues above n * eps(float32) * l_max, the rest 0.
  const auto p = inverse_fourth_roots({a}, &ok, nullptr, {RankDeficient::PseudoInverse, {}, -1});
  ASSERT_TRUE(ok[0]);
  EXPECT_LT(rel_error(p[0], ref_root_rule(a, RankDeficient::PseudoInverse, eps, 64 * 1.1920929e-7)),
            1e-3);
}

// --- the optimizer -----------------------------------------------------------------

std::vector<at::Tensor> full_tensors(uint64_t seed, uint64_t stream) {
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < kCases.size(); ++i) out.push_back(seeded_randn(kCases[i].shape, seed, stream * 10 + i));
  return out;
}

class ShampooRanks : public ::testing::TestWithParam<int> {};

ShampooOptions rank_test_options() {
  ShampooOptions o;
  o.lr = 0.01;
  o.beta1 = 0.9;
  o.beta2 = 0.95;
  o.epsilon = 1e-6;
  o.grafting_beta2 = 0.99;
  o.weight_decay = 0.01;
  return o;
}

ShampooConfig rank_test_config(at::ScalarType factor_dtype = at::kFloat) {
  ShampooConfig c;
  c.max_preconditioner_dim = kB;
  c.precondition_frequency = 5;
  c.start_preconditioning_step = 5;
  c.factor_dtype = factor_dtype;
  return c;
}

constexpr int kSteps = 30;

using Gradients = std::function<std::vector<at::Tensor>(int step)>;  // full tensors, step >= 1

// Case i's rows as torch.chunk splits them over `world` ranks (FSDP2's split, which cuts tiles).
ParamShard chunk_shard_of(size_t i, int world, int rank, const at::Tensor& full) {
  return testing::chunk_shard_of(kCases[i], world, rank, full);
}

// kSteps of Shampoo on `world` ranks (threads), planned with the Shampoo granule
// (or, chunk_rows, split as torch.chunk splits rows, cutting tiles); returns the
// full parameters. Gradients: full_tensors(seed, step) unless given.
std::vector<at::Tensor> run_sharded(int world, uint64_t seed, const ShampooOptions& o,
                                    const ShampooConfig& c, Gradients grads = nullptr,
                                    bool chunk_rows = false, int64_t* shared_rows = nullptr) {
  if (!grads) grads = [seed](int step) { return full_tensors(seed, step); };
  const std::vector<at::Tensor> init = full_tensors(seed, 0);
  const Plan plan = plan_unit(unit_specs(kB), world, 16);
  auto shard = [&](size_t i, int rank, const at::Tensor& full) {
    return chunk_rows ? chunk_shard_of(i, world, rank, full) : shard_of(plan, i, rank, full);
  };
  std::vector<at::Tensor> got(kCases.size());
  for (size_t i = 0; i < kCases.size(); ++i) got[i] = at::zeros({init[i].numel()});
  std::mutex mu;
  run_local_ranks(world, [&](Comm& comm) {
    std::vector<ParamShard> shards;
    for (size_t i = 0; i < kCases.size(); ++i) shards.push_back(shard(i, comm.rank(), init[i]));
    Shampoo opt(shards, o, c, std::shared_ptr<Comm>(&comm, [](Comm*) {}));
    if (shared_rows && comm.rank() == 0) *shared_rows = static_cast<int64_t>(opt.cut_rows().size());
    for (int s = 0; s < kSteps; ++s) {
      const auto g = grads(s + 1);
      for (size_t i = 0; i < kCases.size(); ++i) {
        opt.set_grad(i, shard(i, comm.rank(), g[i]).param);
      }
      opt.step();
    }
    std::lock_guard<std::mutex> lock(mu);
    for (size_t i = 0; i < kCases.size(); ++i) {
      const ParamShard& p = shards[i];
      got[i].narrow(0, p.row_begin * p.row_len, p.param.numel()).copy_(p.param);
    }
  });
  return got;
}

// Every element of got within rel * (1 + |want|) of want.
void expect_close(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want,
                  double rel) {
  for (size_t i = 0; i < kCases.size(); ++i) {
    const at::Tensor w = want[i].to(at::kDouble).reshape(-1);
    const at::Tensor diff = (got[i].to(at::kDouble) - w).abs();
    EXPECT_TRUE((diff <= rel * (1 + w.abs())).all().item<bool>())
        << kCases[i].name << ": max error " << diff.max().item<double>();
  }
}

TEST_P(ShampooRanks, ShardsEqualTheFloat64SingleDeviceShampoo) {
  const int world = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const ShampooOptions o = rank_test_options();
  const ShampooConfig c = rank_test_config();
  RefShampoo ref(full_tensors(seed, 0), o, c);
  for (int s = 0; s < kSteps; ++s) ref.step(full_tensors(seed, s + 1));
  expect_close(run_sharded(world, seed, o, c), ref.x, 2e-4);
}

TEST_P(ShampooRanks, TorchChunkRowsThatCutTilesEqualTheFloat64SingleDeviceShampoo) {
  // FSDP2's rows: a row of tiles that shard boundaries cut is owned by the rank
  // holding its first row, which gathers the others' rows, preconditions it and
  // sends their update rows back.
  const int world = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const ShampooOptions o = rank_test_options();
  const ShampooConfig c = rank_test_config();
  RefShampoo ref(full_tensors(seed, 0), o, c);
  for (int s = 0; s < kSteps; ++s) ref.step(full_tensors(seed, s + 1));
  int64_t shared = -1;
  expect_close(run_sharded(world, seed, o, c, nullptr, true, &shared), ref.x, 2e-4);
  if (world > 1) EXPECT_GT(shared, 0) << "no tile was cut: the test tests nothing new";
}

TEST(Shampoo, CutTileRowsOnTheDeviceGenericPathEqualTheCpuPath) {
  // What a GPU runs (the packing of factors by index ops; the owner exchange and the
  // preconditioning are ATen on every device) on FSDP2's chunk rows, here on the
  // CPU: every parameter bit for bit the CPU path's, on 1 to 4 ranks.
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const ShampooOptions o = rank_test_options();
  const ShampooConfig c = rank_test_config();
  for (int world : {1, 2, 3, 4}) {
    const auto cpu = run_sharded(world, seed, o, c, nullptr, true);
    quant::use_device_generic_path(true);
    const auto generic = run_sharded(world, seed, o, c, nullptr, true);
    quant::use_device_generic_path(false);
    for (size_t i = 0; i < kCases.size(); ++i) {
      EXPECT_TRUE(at::equal(generic[i], cpu[i])) << world << " ranks, " << kCases[i].name;
    }
  }
}

TEST(Shampoo, SharedTileRowWithAGradientOnOnlySomeRanksIsAnErrorEverywhere) {
  // 20 x 19 over 2 ranks: rows [0, 10) and [10, 20) cut the tile rows [8, 16).
  run_local_ranks(2, [&](Comm& comm) {
    const ParamShard p = testing::chunk_shard_of(Case{"w", {20, 19}}, 2, comm.rank(), at::randn({20, 19}));
    Shampoo opt({p}, rank_test_options(), rank_test_config(),
                std::shared_ptr<Comm>(&comm, [](Comm*) {}));
    ASSERT_EQ(opt.cut_rows().size(), 1u);
    const at::Tensor g = at::randn({10, 19});
    if (comm.rank() == 0) opt.set_grad(0, g);
    const at::Tensor before = opt.params()[0].param.clone();
    try {
      opt.step();
      ADD_FAILURE() << "no error on rank " << comm.rank();
    } catch (const std::invalid_argument& err) {
      EXPECT_NE(std::string(err.what()).find("'w'"), std::string::npos) << err.what();
    }
    EXPECT_TRUE(at::equal(opt.params()[0].param, before));
    opt.set_grad(0, g);  // every rank with a gradient: the next step works
    opt.step();
    EXPECT_FALSE(at::equal(opt.params()[0].param, before));
  });
}

TEST(Shampoo, ARefusedStepOnTheHolderOfACutRowNamesItsCauseOnEveryRank) {
  // 20 x 19 over 2 ranks: rank 0 owns the cut tile rows [8, 16). Rank 1 cannot
  // prepare its step (step_refused, as Python's does on a bad gradient): rank 0
  // then also misses rank 1's rows, but the agreed error names rank 1's cause.
  run_local_ranks(2, [&](Comm& comm) {
    const ParamShard p = testing::chunk_shard_of(Case{"w", {20, 19}}, 2, comm.rank(), at::randn({20, 19}));
    Shampoo opt({p}, rank_test_options(), rank_test_config(),
                std::shared_ptr<Comm>(&comm, [](Comm*) {}));
    ASSERT_EQ(opt.cut_rows().size(), 1u);
    const at::Tensor before = opt.params()[0].param.clone();
    try {
      if (comm.rank() == 1) {
        opt.step_refused("the gradient of 'w' is not contiguous", true);
      } else {
        opt.set_grad(0, at::randn({10, 19}));
        opt.step();
      }
      ADD_FAILURE() << "no error on rank " << comm.rank();
    } catch (const std::invalid_argument& err) {
      const std::string what = err.what();
      EXPECT_EQ(what.find("Shampoo step: the gradient of 'w' is not contiguous (on rank 1"), 0u) << what;
    }
    EXPECT_TRUE(at::equal(opt.params()[0].param, before));
  });
}

TEST(Shampoo, Bf16FactorsShardLikeOneRankAndStayNearFloat64) {
  // bf16 storage rounds L, R and the roots (relative 2^-9), so the run drifts
  // from the float64 reference by more than fp32's; sharding must change nothing.
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const ShampooOptions o = rank_test_options();
  const ShampooConfig c = rank_test_config(at::kBFloat16);
  RefShampoo ref(full_tensors(seed, 0), o, rank_test_config());
  for (int s = 0; s < kSteps; ++s) ref.step(full_tensors(seed, s + 1));
  const auto one = run_sharded(1, seed, o, c);
  expect_close(run_sharded(3, seed, o, c), one, 1e-6);
  expect_close(one, ref.x, 3e-3);  // measured: up to 5e-4
}

// Gradients that leave every factor rank-deficient: "big" (20 x 19) of rank 3 in
// a fixed column space (so its momentum stays in that space, as a real layer's
// does), "odd" with its first 5 rows zero, expert 1 of "experts" zero.
std::vector<at::Tensor> deficient_gradients(uint64_t seed, int step) {
  std::vector<at::Tensor> g = full_tensors(seed, step);
  g[0] = at::matmul(seeded_randn({20, 3}, seed, 999), seeded_randn({3, 19}, seed, 1000 + step));
  g[1].narrow(0, 0, 5).zero_();
  g[2][1].zero_();
  return g;
}

TEST_P(ShampooRanks, RankDeficientGradientsUnderShiftAndPseudoInverseEqualTheirFloat64Shampoo) {
  const int world = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Gradients grads = [seed](int step) { return deficient_gradients(seed, step); };
  for (RankDeficient rule : {RankDeficient::Shift, RankDeficient::PseudoInverse}) {
    SCOPED_TRACE(to_string(rule));
    ShampooOptions o = rank_test_options();
    ShampooConfig c = rank_test_config();
    c.rank_deficient = rule;
    if (rule == RankDeficient::PseudoInverse) {
      o.epsilon = 0;  // the pseudo-inverse alone
      c.rank_rtol = 1e-4;  // well above float32 rounding, well below the gradients' spectrum
    }
    RefShampoo ref(full_tensors(seed, 0), o, c);
    for (int s = 0; s < kSteps; ++s) ref.step(grads(s + 1));
    expect_close(run_sharded(world, seed, o, c, grads), ref.x, 2e-4);
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, ShampooRanks, ::testing::Values(1, 2, 3, 4, 8, 16, 32));

// --- quantised roots: every step from the state it starts from -------------------

// Tile j's (of parameter i's tiles) root on one side as stored with quantised
// bases: code indices (n^2), absmax, s (n), and the raw bytes of all three.
struct StoredRoot {
  at::Tensor idx, absmax, s, raw_codes;
};

StoredRoot stored_root(const Shampoo& opt, size_t i, size_t j, bool left) {
  const ShampooConfig& c = opt.config();
  const std::string side = left ? "root_left" : "root_right";
  at::Tensor codes, absmax, s;
  for (const auto& [name, t] : opt.state(i)) {
    if (name == side + "_basis_codes") codes = t;
    if (name == side + "_basis_absmax") absmax = t;
    if (name == side + "_eigenvalues") s = t;
  }
  std::vector<int64_t> sizes;
  for (const Tile& tl : opt.tiles()) {
    if (tl.param == i) sizes.push_back(left ? tl.rows : tl.cols);
  }
  const int64_t n = sizes.at(j);
  const int64_t so = std::accumulate(sizes.begin(), sizes.begin() + j, int64_t{0});
  const LowbitSquare q = lowbit_square(codes, absmax, sizes, j, c.basis.bits, c.basis.block);
  StoredRoot r;
  r.raw_codes = q.raw;
  r.idx = q.idx;
  r.absmax = q.absmax;
  r.s = s.narrow(0, so, n).clone();
  return r;
}

// A rank's parameters and moments as float64 copies.
struct ShampooSnapshot {
  std::vector<at::Tensor> p, m, v;
};

ShampooSnapshot shampoo_snapshot(const Shampoo& opt) {
  ShampooSnapshot s;
  for (size_t i = 0; i < opt.params().size(); ++i) {
    s.p.push_back(opt.params()[i].param.to(at::kDouble).reshape(-1).clone());
    const auto st = opt.state(i);  // exp_avg, exp_avg_sq first
    s.m.push_back(st[0].second.to(at::kDouble).reshape(-1).clone());
    s.v.push_back(st[1].second.to(at::kDouble).reshape(-1).clone());
  }
  return s;
}

// Figures of a run: the largest |Q^T Q - I| of the decoded bases before and after
// Björck, codes checked and skipped.
struct QuantisedFigures {
  double raw_ortho = 0, ortho = 0;
  int64_t checked = 0, skipped = 0;
};

// Checks this rank's step t (b: before) of a Shampoo with quantised roots in
// float64: at a due step each root's s against the shift rule of the float64
// eigenvalues of A (from the factors the step stored) and its codes against
// A's float64 eigenvectors (each column's sign taken from the codes; a code is
// skipped within 1e-5 l_max / gap of a midpoint: how far fp32's eigenvectors
// may lie from float64's); every step, the root it used against the float64
// Björck of its decoded codes times s, and the parameter against a float64
// Shampoo step from those roots and b.
void expect_quantised_step(const Shampoo& opt, const ShampooSnapshot& b,
                           const std::vector<at::Tensor>& grads, int64_t t, QuantisedFigures* fig) {
  const ShampooOptions o = rank_test_options();
  const ShampooConfig& c = opt.config();
  const at::Tensor map = quant::lowbit_map(c.basis.map, c.basis.bits);
  const std::vector<double> code(map.data_ptr<float>(), map.data_ptr<float>() + map.numel());
  const bool due = t % c.precondition_frequency == 0;
  const double bc = 1 - std::pow(o.beta2, static_cast<double>(t));
  std::vector<at::Tensor> u(b.p.size()), mh(b.p.size());
  for (size_t i = 0; i < b.p.size(); ++i) {
    const at::Tensor g = grads[i].to(at::kDouble).reshape(-1);
    const at::Tensor m = o.beta1 * b.m[i] + (1 - o.beta1) * g;
    const at::Tensor v = o.grafting_beta2 * b.v[i] + (1 - o.grafting_beta2) * g * g;
    mh[i] = m / (1 - std::pow(o.beta1, static_cast<double>(t)));
    u[i] = mh[i] / ((v / (1 - std::pow(o.grafting_beta2, static_cast<double>(t)))).sqrt() +
                    o.grafting_epsilon);
  }
  std::map<size_t, size_t> next;
  for (const Tile& tl : opt.tiles()) {
    const size_t i = tl.param, j = next[i]++;
    const std::string where = kCases[i].name + " tile rows " + std::to_string(tl.row0) + " cols " +
                              std::to_string(tl.col0) + ", step " + std::to_string(t);
    at::Tensor roots[2];
    for (bool left : {true, false}) {
      const int64_t n = left ? tl.rows : tl.cols;
      const std::string side = where + (left ? ", left" : ", right");
      const StoredRoot r = stored_root(opt, i, j, left);
      const at::Tensor decoded =
          (map.to(at::kDouble).index_select(0, r.idx) *
           r.absmax.to(at::kDouble).repeat_interleave(c.basis.block).narrow(0, 0, n * n)).view({n, n});
      if (due && t >= c.precondition_frequency) {
        at::Tensor f;
        for (const auto& [name, x] : opt.state(i)) {
          if (name == (left ? "factor_left" : "factor_right")) f = x;
        }
        at::Tensor a = unpack_symmetric(f, left ? tl.left_offset : tl.right_offset, n).to(at::kDouble) / bc;
        a.diagonal().add_(o.epsilon);
        auto [lam, q] = at::linalg_eigh(a);
        const double lo = lam[0].item<double>(), hi = lam[n - 1].item<double>();
        const at::Tensor shifted = lo < o.epsilon ? lam - lo + o.epsilon : lam;
        const at::Tensor s_want = shifted.pow(-0.25);
        // fp32's eigenvalues lie within about 1e-6 l_max of float64's.
        const at::Tensor s_tol = 0.25 * s_want * (1e-5 * hi / shifted) + 1e-6 * s_want;
        EXPECT_TRUE(((r.s.to(at::kDouble) - s_want).abs() <= s_tol).all().item<bool>())
            << "s, " << side << ": " << r.s << " want " << s_want;
        at::Tensor gap = at::full({n}, 1e300, at::kDouble);
        for (int64_t k = 0; k < n; ++k) {
          for (int64_t l = 0; l < n; ++l) {
            if (l != k) gap[k] = std::min(gap[k].item<double>(), std::fabs((lam[k] - lam[l]).item<double>()));
          }
        }
        const at::Tensor sign = at::where((decoded * q).sum(0) < 0, -1.0, 1.0);
        const at::Tensor want = q * sign.unsqueeze(0);
        const at::Tensor tol = (1e-5 * hi / gap).unsqueeze(0).expand({n, n});
        const CodeCheck cc = expect_block_codes(r.idx, r.absmax, want, c.basis.block, code, 1e-6,
                                                "Q, " + side, tol);
        fig->checked += cc.checked;
        fig->skipped += cc.skipped;
      }
      const at::Tensor eye = at::eye(n, at::kDouble);
      fig->raw_ortho = std::max(fig->raw_ortho, (at::mm(decoded.t(), decoded) - eye).abs().max().item<double>());
      const at::Tensor rect = quant::bjorck(decoded, c.basis.bjorck_iterations);
      fig->ortho = std::max(fig->ortho, (at::mm(rect.t(), rect) - eye).abs().max().item<double>());
      roots[left ? 0 : 1] = at::mm(rect * r.s.to(at::kDouble).unsqueeze(0), rect.t());
      const at::Tensor got = opt.root(i, j, left).to(at::kDouble);
      EXPECT_LE((got - roots[left ? 0 : 1]).abs().max().item<double>(),
                1e-5 * roots[left ? 0 : 1].abs().max().item<double>()) << "root, " << side;
    }
    if (t >= c.start_preconditioning_step) {
      at::Tensor d = tile_view(u[i], tl);
      const at::Tensor p = at::mm(at::mm(roots[0], tile_view(mh[i], tl)), roots[1]);
      if (p.norm().item<double>() > 0) d.copy_(p * (d.norm() / p.norm()));
    }
  }
  for (size_t i = 0; i < b.p.size(); ++i) {
    const at::Tensor p = b.p[i] * (1 - o.lr * o.weight_decay) - o.lr * u[i];
    const at::Tensor got = opt.params()[i].param.to(at::kDouble).reshape(-1);
    if (p.numel() == 0) continue;
    const double moved = (p - b.p[i]).abs().max().item<double>();
    EXPECT_TRUE(((got - p).abs() <= 1e-4 * moved + 3e-7 * p.abs()).all().item<bool>())
        << kCases[i].name << ", step " << t << ": largest error " << (got - p).abs().max().item<double>()
        << " of a step of " << moved;
  }
}

// kSteps of Shampoo with config c on `world` ranks (threads; granule plan or,
// chunk_rows, torch.chunk's rows that cut tiles), every step checked on every
// rank (granule plans) by expect_quantised_step; returns every tile side's
// stored codes, absmax and s after every step, by (parameter, matrix, row0,
// col0, side).
using RootCodes = std::map<std::tuple<size_t, int64_t, int64_t, int64_t, bool>, std::vector<at::Tensor>>;
RootCodes run_quantised(int world, uint64_t seed, const ShampooConfig& c, bool chunk_rows,
                        QuantisedFigures* fig, int64_t* bytes, int64_t* fp32_bytes) {
  const std::vector<at::Tensor> init = full_tensors(seed, 0);
  const Plan plan = plan_unit(unit_specs(kB), world, 16);
  auto shard = [&](size_t i, int rank, const at::Tensor& full) {
    return chunk_rows ? chunk_shard_of(i, world, rank, full) : shard_of(plan, i, rank, full);
  };
  RootCodes out;
  std::mutex mu;
  run_local_ranks(world, [&](Comm& comm) {
    std::vector<ParamShard> shards;
    for (size_t i = 0; i < kCases.size(); ++i) shards.push_back(shard(i, comm.rank(), init[i]));
    auto no_delete = std::shared_ptr<Comm>(&comm, [](Comm*) {});
    Shampoo opt(shards, rank_test_options(), c, no_delete);
    ShampooConfig plain = c;
    plain.basis.bits = 0;
    const int64_t fp32 = Shampoo(shards, rank_test_options(), plain, no_delete).factor_bytes();
    QuantisedFigures mine;
    for (int s = 0; s < kSteps; ++s) {
      const auto full = full_tensors(seed, s + 1);
      std::vector<at::Tensor> g;
      for (size_t i = 0; i < kCases.size(); ++i) {
        g.push_back(shard(i, comm.rank(), full[i]).param);
        opt.set_grad(i, g.back());
      }
      const ShampooSnapshot before = shampoo_snapshot(opt);
      opt.step();
      if (!chunk_rows) expect_quantised_step(opt, before, g, s + 1, &mine);
      std::map<size_t, size_t> next;
      for (const Tile& tl : opt.tiles()) {
        const size_t j = next[tl.param]++;
        for (bool left : {true, false}) {
          const StoredRoot r = stored_root(opt, tl.param, j, left);
          std::lock_guard<std::mutex> lock(mu);
          auto& v = out[{tl.param, tl.matrix, tl.row0, tl.col0, left}];
          v.insert(v.end(), {r.raw_codes, r.absmax, r.s});
        }
      }
    }
    std::lock_guard<std::mutex> lock(mu);
    fig->raw_ortho = std::max(fig->raw_ortho, mine.raw_ortho);
    fig->ortho = std::max(fig->ortho, mine.ortho);
    fig->checked += mine.checked;
    fig->skipped += mine.skipped;
    *bytes += opt.factor_bytes();
    *fp32_bytes += fp32;
  });
  return out;
}

class ShampooQuantisedRoots : public ::testing::TestWithParam<int> {};

TEST_P(ShampooQuantisedRoots, EveryStepEqualsTheFloat64QuantisedAlgorithmAndCodesDoNotDependOnTheRanks) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  ShampooConfig c = rank_test_config();
  c.basis.bits = GetParam();
  c.basis.block = 16;
  RootCodes one;
  for (int world : {1, 2, 4, 8, 16}) {
    QuantisedFigures fig;
    int64_t bytes = 0, fp32_bytes = 0;
    const RootCodes got = run_quantised(world, seed, c, false, &fig, &bytes, &fp32_bytes);
    EXPECT_GT(fig.checked, 500) << world << " ranks";
    EXPECT_LT(fig.ortho, c.basis.bits == 4 ? 0.1 : 1e-2) << world << " ranks";
    EXPECT_LT(bytes, fp32_bytes);
    std::cout << "[ figure ] " << world << " ranks, " << c.basis.bits << "-bit root bases: "
              << fig.checked << " codes checked, " << fig.skipped << " on a midpoint; max |Q^T Q - I| "
              << fig.raw_ortho << " decoded, " << fig.ortho << " after Björck; factors and roots "
              << bytes << " B (fp32 roots: " << fp32_bytes << " B)\n";
    if (world == 1) {
      one = got;
      continue;
    }
    EXPECT_EQ(got.size(), one.size());
    for (const auto& [key, v] : got) {
      const auto& w = one.at(key);
      for (size_t k = 0; k < v.size(); ++k) {
        EXPECT_TRUE(at::equal(v[k], w[k])) << world << " ranks, tile of parameter " << std::get<0>(key)
                                           << " row " << std::get<2>(key) << ", entry " << k;
      }
    }
  }
  // Torch's chunk rows (tiles cut, shared by their ranks): the same codes.
  QuantisedFigures fig;
  int64_t bytes = 0, fp32_bytes = 0;
  const RootCodes chunk = run_quantised(3, seed, c, true, &fig, &bytes, &fp32_bytes);
  EXPECT_EQ(chunk.size(), one.size());
  for (const auto& [key, v] : chunk) {
    for (size_t k = 0; k < v.size(); ++k) {
      EXPECT_TRUE(at::equal(v[k], one.at(key)[k])) << "chunk rows, tile of parameter " << std::get<0>(key)
                                                  << " row " << std::get<2>(key) << ", entry " << k;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Bits, ShampooQuantisedRoots, ::testing::Values(8, 4));

// --- a failed step: agreed by every rank, nothing changed ---------------------------

class ShampooGate : public ::testing::TestWithParam<int> {};

TEST_P(ShampooGate, ARootFailureOnOneRanksTileStopsEveryRankAtOnceAndALaterStepWorks) {
  // One rank's left factors of "big" turn NaN (as a corrupted state would):
  // every root there fails, the third failure in a row is an error, and every
  // rank raises it at once, naming the tile and the rank, with nothing changed.
  const int world = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Plan plan = plan_unit(unit_specs(kB), world, 16);
  const std::vector<at::Tensor> init = full_tensors(seed, 0);
  int failing = world - 1;  // the last rank that holds rows of "big"
  while (shard_of(plan, 0, failing, init[0]).rows() == 0) --failing;
  const ParamShard last = shard_of(plan, 0, failing, init[0]);
  ShampooConfig c = rank_test_config();
  c.precondition_frequency = 1;
  c.start_preconditioning_step = 1;
  std::mutex mu;
  std::vector<std::string> messages(world);
  std::vector<double> seconds(world);
  run_local_ranks(world, [&](Comm& comm) {
    std::vector<ParamShard> shards;
    for (size_t i = 0; i < kCases.size(); ++i) shards.push_back(shard_of(plan, i, comm.rank(), init[i]));
    Shampoo opt(shards, rank_test_options(), c, std::shared_ptr<Comm>(&comm, [](Comm*) {}));
    auto give = [&](int step) {
      const auto g = full_tensors(seed, step);
      for (size_t i = 0; i < kCases.size(); ++i) {
        opt.set_grad(i, shard_of(plan, i, comm.rank(), g[i]).param);
      }
    };
    at::Tensor left;
    for (auto& [name, t] : opt.state(0)) {
      if (name == "factor_left") left = t;
    }
    give(1), opt.step();
    if (comm.rank() == failing) left.fill_(std::nan(""));
    for (int step = 2; step <= 3; ++step) give(step), opt.step();  // failures 1 and 2: roots kept
    give(4);
    std::vector<at::Tensor> before;
    for (size_t i = 0; i < kCases.size(); ++i) {
      before.push_back(shards[i].param.clone());
      for (const auto& [name, t] : opt.state(i)) before.push_back(t.clone());
    }
    const auto t0 = std::chrono::steady_clock::now();
    try {
      opt.step();
      ADD_FAILURE() << "rank " << comm.rank() << " took the step";
    } catch (const std::runtime_error& e) {
      std::lock_guard<std::mutex> lock(mu);
      messages[comm.rank()] = e.what();
      seconds[comm.rank()] =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    size_t k = 0;
    for (size_t i = 0; i < kCases.size(); ++i) {
      // NaN == NaN for this check: the factors that were NaN stay NaN, bit for bit
      EXPECT_TRUE(at::equal(shards[i].param, before[k++])) << "parameter " << kCases[i].name;
      for (const auto& [name, t] : opt.state(i)) {
        const at::Tensor& b = before[k++];
        EXPECT_TRUE(at::equal(t.isnan(), b.isnan()) && at::equal(t.nan_to_num(0), b.nan_to_num(0)))
            << kCases[i].name << " " << name;
      }
      EXPECT_EQ(opt.step_count(i), 3);
    }
    // The state mended (as a reload would): the ranks step on together.
    left.zero_();
    opt.step();
    EXPECT_EQ(opt.step_count(0), 4);
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(messages[r], messages[0]) << "rank " << r;
    EXPECT_LT(seconds[r], 20.0) << "rank " << r << " waited (the harness timeout is 60 s)";
  }
  const std::string& m = messages[0];
  EXPECT_NE(m.find("Shampoo step: the inverse roots of parameter 'big' tile of matrix 0 rows [" +
                   std::to_string(last.row_begin)),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("3 times in a row"), std::string::npos) << m;
  if (world > 1) {
    EXPECT_NE(m.find("(on rank " + std::to_string(failing) + ")"), std::string::npos) << m;
    EXPECT_NE(m.find("not taken on any rank"), std::string::npos) << m;
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, ShampooGate, ::testing::Values(1, 2, 3));

TEST(Shampoo, ThreeRootFailuresInARowAreAnErrorNamingTheTile) {
  ShampooConfig c;
  c.max_preconditioner_dim = 4;
  c.precondition_frequency = 1;
  c.start_preconditioning_step = 1;
  at::Tensor w = at::randn({6, 4}), g = at::randn({6, 4});
  ShampooOptions o;
  o.epsilon = 1e-3;  // the 2-row tile's 4x4 right factor has rank 2: its root needs epsilon
  Shampoo opt({whole_param("w", w, g)}, o, c);
  opt.step();  // roots computed: fine
  EXPECT_EQ(opt.fp64_retries(), 0);
  at::Tensor left;
  for (auto& [name, t] : opt.state(0)) {
    if (name == "factor_left") left = t;
  }
  left.fill_(std::nan(""));  // every root of the left factors fails from now on
  opt.step();
  opt.step();
  try {
    opt.step();
    FAIL() << "no error after three failures";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("parameter 'w' tile of matrix 0 rows [0, 4)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("3 times in a row"), std::string::npos) << msg;
  }
  EXPECT_GE(opt.fp64_retries(), 3);
}

TEST(Shampoo, BadSettingsAndNanGradientsAreClearErrors) {
  at::Tensor w = at::randn({6, 4}), g = at::randn({6, 4});
  ShampooConfig c;
  c.precondition_frequency = 10;
  c.start_preconditioning_step = 5;
  EXPECT_THROW(Shampoo({whole_param("w", w, g)}, {}, c), std::invalid_argument);
  ShampooOptions o;
  o.beta1 = 1.0;
  EXPECT_THROW(Shampoo({whole_param("w", w, g)}, o), std::invalid_argument);
  o = {};
  o.epsilon = 0;  // the shift lifts the spectrum to epsilon: 0 is refused, by name
  try {
    Shampoo({whole_param("w", w, g)}, o);
    ADD_FAILURE() << "shift with epsilon 0 was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("pseudo_inverse"), std::string::npos) << e.what();
  }
  ShampooConfig pc;
  pc.rank_deficient = RankDeficient::PseudoInverse;
  Shampoo ok_with_zero({whole_param("w", w, g)}, o, pc);  // the pseudo-inverse takes it
  pc.rank_rtol = 1.0;
  EXPECT_THROW(Shampoo({whole_param("w", w, g)}, {}, pc), std::invalid_argument);
  EXPECT_EQ(parse_rank_deficient("pseudo_inverse"), RankDeficient::PseudoInverse);
  EXPECT_THROW(parse_rank_deficient("pinv"), std::invalid_argument);
  Shampoo opt({whole_param("w", w, g)});
  const at::Tensor before = w.clone();
  g[0][0] = std::nan("");
  EXPECT_THROW(opt.step(), std::runtime_error);
  EXPECT_TRUE(at::equal(w, before));
  EXPECT_EQ(opt.step_count(0), 0);
}


TEST(ShampooColumnParts, PiecesOfColumnBlocksEqualTheFloat64SingleDeviceShampoo) {
  // Tensor parallelism's Shard(1) (RowwiseParallel) under FSDP's row chunks, 4
  // ranks (rank r: part r % parts, rows chunk[r] of it): a 10 x 16 matrix in 2
  // parts of 8, rows 5 + 5 (cutting a row of tiles: owned and exchanged), and a
  // 6 x 12 one in 3 parts of 4 held whole by ranks 0-2 (rank 3 none). B = 4
  // divides the widths, so every tile of the global matrix lies in one part.
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<ColumnPartsMatrix> mats = {{"w0", {10, 16}, 2, {{0, 5}, {0, 5}, {5, 10}, {5, 10}}},
                                               {"w1", {6, 12}, 3, {{0, 6}, {0, 6}, {0, 6}, {0, 0}}}};
  const ShampooOptions o = rank_test_options();
  ShampooConfig c = rank_test_config();
  c.max_preconditioner_dim = 4;
  auto full = [&](int step) {
    std::vector<at::Tensor> out;
    for (size_t t = 0; t < mats.size(); ++t) out.push_back(seeded_randn(mats[t].shape, seed, 10 * step + t));
    return out;
  };
  RefShampoo ref(full(0), o, c);
  for (int s = 0; s < kSteps; ++s) ref.step(full(s + 1));
  auto piece = [&](const at::Tensor& x, size_t t, int r) { return mats[t].piece(x, r).contiguous(); };
  std::vector<at::Tensor> got = {at::zeros(mats[0].shape), at::zeros(mats[1].shape)};
  std::atomic<int64_t> cut{0};
  std::mutex mu;
  run_local_ranks(4, [&](Comm& comm) {
    const int r = comm.rank();
    const std::vector<at::Tensor> init = full(0);
    std::vector<ParamShard> shards;
    for (size_t t = 0; t < mats.size(); ++t) shards.emplace_back(mats[t].shard(r), piece(init[t], t, r));
    Shampoo opt(shards, o, c, std::shared_ptr<Comm>(&comm, [](Comm*) {}));
    if (r == 0) cut = static_cast<int64_t>(opt.cut_rows().size());
    for (int s = 0; s < kSteps; ++s) {
      const auto g = full(s + 1);
      for (size_t t = 0; t < mats.size(); ++t) opt.set_grad(t, piece(g[t], t, r));
      opt.step();
    }
    std::lock_guard<std::mutex> lock(mu);
    for (size_t t = 0; t < mats.size(); ++t) {
      mats[t].piece(got[t], r).copy_(shards[t].param.view({-1, mats[t].width()}));
    }
  });
  EXPECT_GT(cut.load(), 0) << "no row of tiles was cut: the exchange is not tested";
  for (size_t t = 0; t < mats.size(); ++t) {
    const at::Tensor w = ref.x[t].reshape(-1);
    const at::Tensor diff = (got[t].to(at::kDouble).reshape(-1) - w).abs();
    EXPECT_TRUE((diff <= 2e-4 * (1 + w.abs())).all().item<bool>())
        << "matrix " << t << ": max error " << diff.max().item<double>();
  }
}

TEST(ShampooColumnParts, TilesThePartsWouldCutAreAClearError) {
  ParamShard s(TensorShard::column_parts("proj", {8, 12}, 2, 0, 8), at::zeros({8, 6}));
  ShampooConfig c;
  c.max_preconditioner_dim = 4;
  try {
    Shampoo opt({s}, {}, c);
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    for (const char* want : {"Shampoo: parameter 'proj'", "2 column parts of 6 columns", "Shard(1)",
                             "max_preconditioner_dim=4", "divides 6"}) {
      EXPECT_NE(msg.find(want), std::string::npos) << want << " not in: " << msg;
    }
  }
}

}  // namespace
}  // namespace rfsdp
