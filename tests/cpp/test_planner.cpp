// The planner against (1) an exhaustive search written independently here on
// small units, (2) the validator and a shard-tiling check on thousands of
// random units, (3) the model zoo, and (4) bad input.
#include <gtest/gtest.h>

#include <dirent.h>

#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <tuple>

#include "core/ragged/plan_json.h"
#include "core/ragged/planner.h"
#include "core/ragged/tensor_shard.h"

namespace rfsdp {
namespace {

std::mt19937_64 fresh_rng(uint64_t* seed_out) {
  *seed_out = std::random_device{}() ^ (static_cast<uint64_t>(std::random_device{}()) << 32);
  return std::mt19937_64(*seed_out);
}

TensorSpec spec(const std::string& name, std::vector<int64_t> shape, int64_t granule_rows) {
  TensorSpec t;
  t.name = name;
  t.shape = std::move(shape);
  t.granule_rows = granule_rows;
  return t;
}

int64_t uniform(std::mt19937_64& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

// ---- (1) exhaustive reference: every tensor order, every aligned offset ----

struct Exhaustive {
  std::vector<int64_t> n, G;
  int64_t m, S, A;
  std::map<std::pair<int64_t, unsigned>, bool> memo;

  bool offset_ok(size_t t, int64_t o) const {
    for (int64_t k = 1; k < m; ++k) {
      const int64_t b = k * S;
      if (b > o && b < o + n[t] && (b - o) % G[t] != 0) return false;
    }
    return true;
  }
  // Can the tensors not in `placed` be laid out at or after `cursor`?
  bool rest_fits(int64_t cursor, unsigned placed) {
    if (placed == (1u << n.size()) - 1) return true;
    const auto key = std::make_pair(cursor, placed);
    if (auto it = memo.find(key); it != memo.end()) return it->second;
    bool ok = false;
    for (size_t t = 0; t < n.size() && !ok; ++t) {
      if (placed & (1u << t)) continue;
      for (int64_t o = (cursor + A - 1) / A * A; o + n[t] <= m * S && !ok; o += A) {
        ok = offset_ok(t, o) && rest_fits(o + n[t], placed | (1u << t));
      }
    }
    return memo[key] = ok;
  }
};

int64_t exhaustive_optimum(const std::vector<TensorSpec>& ts, int64_t m, int64_t A) {
  Exhaustive ex;
  int64_t total = 0;
  for (const auto& t : ts) {
    ex.n.push_back(t.numel());
    ex.G.push_back(t.granule_elems());
    total += t.numel();
  }
  ex.m = m;
  ex.A = A;
  for (int64_t S = (total + m - 1) / m; ; ++S) {
    if (S % A) continue;
    ex.S = S;
    ex.memo.clear();
    if (ex.rest_fits(0, 0)) return S;
  }
}

TensorSpec random_small_tensor(std::mt19937_64& rng, int i) {
  TensorSpec t;
  t.name = "t" + std::to_string(i);
  t.elem_bytes = 4;
  switch (uniform(rng, 0, 2)) {
    case 0: t.shape = {uniform(rng, 1, 12)}; break;
    case 1: t.shape = {uniform(rng, 1, 6), uniform(rng, 1, 4)}; break;
    default:
      t.shape = {uniform(rng, 1, 2), uniform(rng, 1, 3), uniform(rng, 1, 3)};
      t.row_dims = static_cast<int>(uniform(rng, 1, 2));
  }
  const int64_t g = uniform(rng, 0, 3);
  t.granule_rows = g == 0 ? kWholeTensor : g;
  return t;
}

PlannerOptions one_buffer() {
  PlannerOptions o;
  o.max_buffers = 1;
  return o;
}

// The exhaustive reference is for one buffer (several buffers have their own tests).
TEST(Planner, MatchesExhaustiveSearchOnSmallUnits) {
  uint64_t seed;
  auto rng = fresh_rng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  int padded = 0;  // cases whose optimum needs padding: the search had work to do
  for (int c = 0; c < 400; ++c) {
    std::vector<TensorSpec> unit;
    const int T = static_cast<int>(uniform(rng, 1, 4));
    for (int i = 0; i < T; ++i) unit.push_back(random_small_tensor(rng, i));
    const int64_t m = uniform(rng, 1, 5);
    const int64_t align_bytes = int64_t{4} << uniform(rng, 0, 2);  // 1, 2 or 4 fp32 elements
    const Plan plan = plan_unit(unit, m, align_bytes, one_buffer());
    ASSERT_TRUE(plan_violations(plan).empty()) << plan_violations(plan).front();
    const int64_t best = exhaustive_optimum(unit, m, plan.align_elems());
    ASSERT_EQ(plan.shard_elems, best) << "case " << c << ": planner S vs exhaustive optimum";
    // The structural bound is a true lower bound.
    ASSERT_LE(structural_lower_bound(unit, m, align_bytes), best) << "case " << c;
    int64_t total = 0;
    for (const auto& t : unit) total += t.numel();
    if (best * m > total) ++padded;
  }
  // The random units must reach plans that need padding (granules, whole tensors,
  // alignment), not only the trivial even split.
  EXPECT_GE(padded, 100);
}

// ---- (2) property test over random units, validator + tiling ----

TensorSpec random_tensor(std::mt19937_64& rng, int i, int64_t elem_bytes) {
  TensorSpec t;
  t.name = "p" + std::to_string(i);
  t.elem_bytes = elem_bytes;
  switch (uniform(rng, 0, 4)) {
    case 0: t.shape = {uniform(rng, 1, 5000)}; break;                         // 1-D
    case 1: t.shape = {1, uniform(rng, 1, 3000)}; break;                      // one row
    case 2: t.shape = {uniform(rng, 1, 600), uniform(rng, 1, 600)}; break;    // matrix
    case 3:                                                                    // expert stack
      t.shape = {uniform(rng, 1, 16), uniform(rng, 1, 64), uniform(rng, 1, 64)};
      t.row_dims = static_cast<int>(uniform(rng, 1, 2));
      break;
    default: t.shape = {uniform(rng, 1, 4), uniform(rng, 1, 4), uniform(rng, 1, 4), 3};
  }
  switch (uniform(rng, 0, 4)) {
    case 0: t.granule_rows = kWholeTensor; break;
    case 1: t.granule_rows = 1; break;
    case 2: t.granule_rows = int64_t{1} << uniform(rng, 1, 7); break;  // 2..128
    case 3: t.granule_rows = uniform(rng, 1, 100); break;
    default: t.granule_rows = t.rows() + uniform(rng, 0, 5);            // >= rows: whole
  }
  return t;
}

// Every tensor's rank pieces, in rank order, are contiguous whole granules that
// cover its rows exactly once, at the right place in each rank's slice (inside
// its buffer's part of the slice).
void expect_tiles(const Plan& p) {
  for (size_t i = 0; i < p.tensors.size(); ++i) {
    const TensorSpec& t = p.tensors[i];
    const size_t b = p.buffer_index(i);
    const int64_t S = p.buffer_shard(b), base = p.buffer_local_begin(b);
    const int64_t first = p.offsets[i] / S, last = (p.offsets[i] + t.numel() - 1) / S;
    int64_t next_row = 0, covered = 0;
    for (int64_t r = 0; r < p.world_size; ++r) {
      if (r < first - 1 || (r > last + 1 && r < p.world_size - 1)) continue;  // far ranks: below
      const ShardRange s = p.shard(i, r);
      if (r < first || r > last) {
        ASSERT_TRUE(s.empty()) << t.name << " rank " << r;
        continue;
      }
      ASSERT_FALSE(s.empty()) << t.name << " rank " << r;
      ASSERT_EQ(s.row_begin, next_row) << t.name << " rank " << r;
      ASSERT_EQ(s.row_begin % t.effective_granule_rows(), 0) << t.name << " rank " << r;
      ASSERT_EQ(s.numel, (s.row_end - s.row_begin) * t.row_elems());
      ASSERT_GE(s.local_offset, base);
      ASSERT_LE(s.local_offset + s.numel, base + S);
      ASSERT_EQ(r * S + s.local_offset - base, p.offsets[i] + s.row_begin * t.row_elems());
      next_row = s.row_end;
      covered += s.row_end - s.row_begin;
    }
    ASSERT_EQ(next_row, t.rows()) << t.name;
    ASSERT_EQ(covered, t.rows()) << t.name;
    // A far rank (when there is one) holds nothing of the tensor.
    if (last + 2 < p.world_size) ASSERT_TRUE(p.shard(i, last + 2).empty());
    if (first >= 2) ASSERT_TRUE(p.shard(i, first - 2).empty());
  }
}

TEST(Planner, RandomUnitsValidateAndTile) {
  uint64_t seed;
  auto rng = fresh_rng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t world_sizes[] = {1, 2, 3, 4, 7, 8, 64, 1000, 16384};
  const int64_t elem_sizes[] = {1, 2, 4, 8};
  const int64_t aligns[] = {1, 4, 16, 16, 16, 128};
  int several = 0;  // plans with several buffers
  for (int c = 0; c < 3000; ++c) {
    const int64_t eb = elem_sizes[uniform(rng, 0, 3)];
    std::vector<TensorSpec> unit;
    const int T = static_cast<int>(uniform(rng, 0, 3) == 0 ? uniform(rng, 1, 3) : uniform(rng, 1, 40));
    for (int i = 0; i < T; ++i) unit.push_back(random_tensor(rng, i, eb));
    const int64_t m = world_sizes[uniform(rng, 0, 8)];
    const int64_t align = aligns[uniform(rng, 0, 5)];
    // Several buffers, at times with collectives for free (then as many as pad less).
    PlannerOptions options;
    if (uniform(rng, 0, 1)) options.collective_cost_bytes = 0;
    const Plan p = plan_unit(unit, m, align, options);
    const Plan single = plan_unit(unit, m, align, one_buffer());
    const auto bad = plan_violations(p);
    ASSERT_TRUE(bad.empty()) << "case " << c << ": " << bad.front();
    ASSERT_TRUE(plan_violations(single).empty()) << "case " << c;
    ASSERT_GE(p.shard_elems, any_buffers_lower_bound(unit, m, align));
    ASSERT_GE(any_buffers_lower_bound(unit, m, align), p.lower_bound_shard_elems());
    ASSERT_GE(single.shard_elems, structural_lower_bound(unit, m, align));
    ASSERT_EQ(single.num_buffers(), 1u);
    ASSERT_LE(p.num_buffers(), static_cast<size_t>(options.max_buffers));
    // Never worse than one buffer by the planner's own measure, and one buffer on ties.
    const auto cost = [&](const Plan& x) {
      return m * x.shard_elems * x.elem_bytes +
             static_cast<int64_t>(x.num_buffers()) * options.collective_cost_bytes;
    };
    ASSERT_LE(cost(p), cost(single)) << "case " << c;
    if (p.num_buffers() > 1) {
      ASSERT_LT(cost(p), cost(single)) << "case " << c;
      ++several;
    }
    expect_tiles(single);
    expect_tiles(p);
    ASSERT_EQ(p.tensors.size(), unit.size());
    for (size_t i = 0; i < unit.size(); ++i) ASSERT_EQ(p.tensors[i].name, unit[i].name);
    expect_tiles(p);
    if (HasFatalFailure()) {
      ADD_FAILURE() << "case " << c << " m " << m;
      return;
    }
  }
  EXPECT_GE(several, 20);  // the random units do reach several buffers (about 90 in 3000)
}

// A tensor's shard descriptor from a plan: its own rows and every rank's are
// the plan's ranges, every rank's rows tile the tensor in rank order, and the row
// geometry is TensorSpec's.
TEST(TensorShard, OfPlanHoldsEveryRanksRowsAndTheirsTileTheTensor) {
  uint64_t seed;
  auto rng = fresh_rng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (int c = 0; c < 200; ++c) {
    std::vector<TensorSpec> unit;
    const int T = static_cast<int>(uniform(rng, 1, 12));
    for (int i = 0; i < T; ++i) unit.push_back(random_tensor(rng, i, 4));
    const int64_t m = uniform(rng, 1, 9);
    const Plan p = plan_unit(unit, m, 16);
    for (size_t i = 0; i < p.tensors.size(); ++i) {
      const TensorSpec& t = p.tensors[i];
      int64_t next = 0;
      for (int64_t r = 0; r < m; ++r) {
        const TensorShard s = TensorShard::of_plan(p, i, r);
        const ShardRange want = p.shard(i, r);
        ASSERT_EQ(s.name, t.name);
        ASSERT_EQ(s.shape, t.shape);
        ASSERT_EQ(s.full_rows, t.rows());
        ASSERT_EQ(s.row_len, t.row_elems());
        ASSERT_EQ(s.row_begin, want.row_begin) << "case " << c;
        ASSERT_EQ(s.row_end, want.row_end) << "case " << c;
        ASSERT_EQ(s.numel(), want.numel);
        ASSERT_EQ(s.rank_rows.size(), static_cast<size_t>(m));
        for (int64_t q = 0; q < m; ++q) {
          ASSERT_EQ(s.rank_rows[q], std::make_pair(p.shard(i, q).row_begin, p.shard(i, q).row_end));
        }
        if (want.row_end > want.row_begin) {  // rank order, no gap, no overlap
          ASSERT_EQ(want.row_begin, next) << "case " << c << " tensor " << t.name << " rank " << r;
          next = want.row_end;
        }
      }
      ASSERT_EQ(next, t.rows()) << "case " << c << " tensor " << t.name;
    }
  }
}

TEST(TensorShard, BadRowsOrRowDimsAreErrorsNamingTheTensor) {
  const auto refused = [](auto make, const std::string& words) {
    try {
      make();
      ADD_FAILURE() << "accepted: " << words;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  refused([] { TensorShard::rows_of("w", {4, 5}, 3, 0, 4); }, "tensor 'w': row_dims 3 is out of range");
  refused([] { TensorShard::rows_of("w", {4, 5}, 1, 2, 5); }, "tensor 'w': rows [2, 5) do not lie");
  refused([] { TensorShard::rows_of("w", {4, 5}, 1, 3, 2); }, "tensor 'w': rows [3, 2)");
  refused([] { TensorShard::rows_of("e", {2, 3, 4}, 2, 0, 6, {{0, 6}, {6, 7}}); },
          "tensor 'e': a rank's rows [6, 7)");
  const TensorShard e = TensorShard::whole("e", {2, 3, 4}, 2);
  EXPECT_EQ(e.full_rows, 6);
  EXPECT_EQ(e.row_len, 4);
  EXPECT_EQ(e.rows(), 6);
  EXPECT_FALSE(e.knows_every_rank());
  const TensorShard scalar = TensorShard::whole("s", {});
  EXPECT_EQ(scalar.full_rows, 1);
  EXPECT_EQ(scalar.numel(), 1);
}

// Two matrices with row lengths 7 and 9 on 8 ranks: one buffer needs S to be a
// multiple of both granule spacings (lcm(28, 36) = 252 elements, fp32, 16-byte
// alignment); two buffers fit both exactly (56 + 72 = the size bound 128).
TEST(Planner, SeveralBuffersWhenOneBufferMustPad) {
  const TensorSpec a = spec("a", {64, 7}, 1), b = spec("b", {64, 9}, 1), bias = spec("bias", {9}, 1);
  PlannerOptions free_collectives;
  free_collectives.collective_cost_bytes = 0;
  const Plan single = plan_unit({a, b}, 8, 16, one_buffer());
  EXPECT_GT(single.shard_elems, 128);
  const Plan two = plan_unit({a, b}, 8, 16, free_collectives);
  ASSERT_TRUE(plan_violations(two).empty()) << plan_violations(two).front();
  ASSERT_EQ(two.num_buffers(), 2u);
  EXPECT_EQ(two.shard_elems, 128);
  EXPECT_EQ(two.buffer_shard(two.buffer_index(0)), 56);
  EXPECT_EQ(two.buffer_shard(two.buffer_index(1)), 72);
  expect_tiles(two);
  // Priced: 8 ranks x (S_single - 128) x 4 bytes saved against one more collective.
  PlannerOptions priced;
  priced.collective_cost_bytes = 8 * (single.shard_elems - 128) * 4;
  EXPECT_EQ(plan_unit({a, b}, 8, 16, priced).num_buffers(), 1u);  // a tie: one buffer
  priced.collective_cost_bytes /= 2;
  EXPECT_EQ(plan_unit({a, b}, 8, 16, priced).num_buffers(), 2u);
  // A small tensor joins a buffer, or takes one of its own when that pads less.
  const Plan three = plan_unit({a, bias, b}, 8, 16, free_collectives);
  ASSERT_TRUE(plan_violations(three).empty());
  EXPECT_EQ(three.tensors[1].name, "bias");
  expect_tiles(three);
  EXPECT_LE(three.shard_elems, 128 + 4);
  // --max-buffers 1 is one buffer whatever the price.
  EXPECT_EQ(plan_unit({a, b}, 8, 16, [] {
              PlannerOptions o = one_buffer();
              o.collective_cost_bytes = 0;
              return o;
            }()).num_buffers(), 1u);
}

TEST(Planner, MoreRanksThanGranules) {
  const TensorSpec a = spec("a", {3, 4}, 1), b = spec("b", {3, 4}, kWholeTensor);
  const Plan p = plan_unit({a, b}, 16384, 16);
  EXPECT_TRUE(plan_violations(p).empty());
  EXPECT_EQ(p.shard_elems, 12);  // b whole needs 12 elements on one rank
  expect_tiles(p);
}

// ---- (3) the zoo: every unit plans validly at small and large world sizes ----

TEST(Planner, ZooUnitsPlanValidly) {
  DIR* d = opendir(RFSDP_ZOO_DIR);
  ASSERT_NE(d, nullptr);
  int units = 0;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name.size() < 6 || name.substr(name.size() - 5) != ".json") continue;
    std::ifstream in(std::string(RFSDP_ZOO_DIR) + "/" + name);
    std::stringstream text;
    text << in.rdbuf();
    auto unit = unit_from_json(text.str());
    for (int64_t g : {int64_t{1}, int64_t{32}}) {
      for (auto& t : unit) t.granule_rows = g;
      for (int64_t m : {8, 1024, 16384}) {
        const Plan single = plan_unit(unit, m, 16, one_buffer());
        const Plan p = plan_unit(unit, m);
        EXPECT_TRUE(plan_violations(single).empty()) << name << " m " << m;
        EXPECT_TRUE(plan_violations(p).empty()) << name << " m " << m;
        EXPECT_GE(single.shard_elems, structural_lower_bound(unit, m));
        EXPECT_LE(p.shard_elems, single.shard_elems) << name << " m " << m;
        // The target for element-wise optimizers: 1-row granules pad <= 3 %
        // at m = 1024 on every unit of the zoo.
        if (g == 1 && m == 1024) EXPECT_LE(p.padding_fraction(), 0.03) << name;
      }
    }
    ++units;
  }
  closedir(d);
  EXPECT_GE(units, 10);
}

// ---- (4) bad input: one-line errors naming the tensor ----

void expect_plan_error(const std::vector<TensorSpec>& unit, int64_t m, const std::string& needle,
                       int64_t align_bytes = 16, const PlannerOptions& options = {}) {
  try {
    plan_unit(unit, m, align_bytes, options);
    FAIL() << "no error; expected " << needle;
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

PlannerOptions options(int64_t max_buffers, int64_t collective_cost_bytes) {
  PlannerOptions o;
  o.max_buffers = max_buffers;
  o.collective_cost_bytes = collective_cost_bytes;
  return o;
}

TEST(Planner, BadInput) {
  TensorSpec t;
  t.name = "w";
  t.shape = {4, 4};
  expect_plan_error({}, 2, "empty");
  expect_plan_error({t}, 0, "world size must be between 1 and 16777216");
  expect_plan_error({t}, -3, "world size must be between 1 and 16777216");
  expect_plan_error({t, t}, 2, "'w': duplicate");
  auto bad = t;
  bad.shape = {4, -1};
  expect_plan_error({bad}, 2, "'w': dim 1 is -1");
  bad = t;
  bad.granule_rows = 0;
  expect_plan_error({bad}, 2, "'w': granule_rows must be a positive integer");
  bad = t;
  bad.row_dims = 5;
  expect_plan_error({bad}, 2, "'w': row_dims 5 is out of range");
  expect_plan_error({t}, 2, "planner: max_buffers must be between 1 and 64", 16, options(0, 0));
  expect_plan_error({t}, 2, "planner: collective_cost_bytes must be between 0 and", 16,
                    options(2, -1));
}

// Absurd sizes: refused naming the value and the limit (planner.h), never a
// search that spins (m = 2^62 ran forever), an S from an overflowed m x S (m = 2^60
// gave S = 1028) or an option cut to int (4294967297 buffers became 1).
TEST(Planner, AbsurdSizesAreRefusedNamingTheLimit) {
  TensorSpec t = spec("w", {4, 4}, 1);
  for (int64_t m : {kMaxWorldSize + 1, int64_t{1} << 60, int64_t{1} << 62,
                    std::numeric_limits<int64_t>::max()}) {
    expect_plan_error({t}, m, "world size must be between 1 and 16777216 (2^24: the planner's "
                              "limit), got " + std::to_string(m));
  }
  // At the limit it plans: one row (a granule) per rank on the first 4 ranks.
  const Plan at_limit = plan_unit({t}, kMaxWorldSize);
  validate_plan(at_limit);
  EXPECT_EQ(at_limit.shard_elems, 4);
  expect_plan_error({t}, 2, "planner: max_buffers must be between 1 and 64 (the planner's limit; "
                           "it forms at most 7), got 4294967297", 16, options(4294967297, 0));
  expect_plan_error({t}, 2, "max_buffers must be between 1 and 64 (the planner's limit; it "
                           "forms at most 7), got 65", 16, options(65, 0));
  expect_plan_error({t}, 2, "planner: collective_cost_bytes must be between 0 and 1125899906842624 "
                           "(2^50: the planner's limit), got 1125899906842625", 16,
                    options(2, (int64_t{1} << 50) + 1));
  for (int64_t align : {int64_t{0}, (int64_t{1} << 20) + 1, int64_t{1} << 40}) {
    expect_plan_error({t}, 2, "align_bytes must be between 1 and 1048576 (2^20: the planner's "
                              "limit), got " + std::to_string(align), align);
  }
  TensorSpec wide = t;
  wide.elem_bytes = int64_t{1} << 40;
  expect_plan_error({wide}, 2, "'w': dtype_bytes must be between 1 and 1024, got 1099511627776");
  // m x elements x dtype_bytes up to 2^60 plans (one row of 2^17 elements a rank) ...
  TensorSpec big = spec("big", {int64_t{1} << 17, int64_t{1} << 17}, 1);
  const Plan largest = plan_unit({big}, kMaxWorldSize);
  validate_plan(largest);
  EXPECT_EQ(largest.shard_elems, int64_t{1} << 17);
  // ... one more row (aligned: 4 more elements) is refused, as is a sum past int64.
  big.shape[0] += 1;
  expect_plan_error({big}, kMaxWorldSize,
                    "the unit is too large for world size 16777216: world size x 17180000256 "
                    "elements");
  std::vector<TensorSpec> huge;
  for (int k = 0; k < 32; ++k) {  // 2^58 elements each
    huge.push_back(spec("h" + std::to_string(k), {int64_t{1} << 29, int64_t{1} << 29}, 1));
    huge.back().elem_bytes = 1;
  }
  expect_plan_error(huge, 1, "world size x more than 2^63 elements");
  EXPECT_THROW(structural_lower_bound(huge, 1), std::invalid_argument);  // (the bounds check too)
}

}  // namespace
}  // namespace rfsdp
