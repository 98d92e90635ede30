// Every optimizer and variant at 8, 16 and 32 thread ranks and on HSDP meshes
// (4 x 4, 2 x 8), on one small model whose plan has a tensor spanning many
// ranks, ranks holding nothing of most tensors and a 3-D expert stack whose
// experts straddle ranks: after a few steps every rank's rows equal the same
// optimizer's on one device (bit for bit where the step is element-wise; to
// fp32 rounding where it multiplies matrices or solves eigenproblems, whose
// BLAS rounding may depend on the operands' alignment and batch). Layouts: the
// planner's (granules from the optimizer's blocks or tiles, or 1 row: blocks and
// tiles cut and shared), and FSDP2's torch.chunk rows along dim 0.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <ostream>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/comm/hybrid_groups.h"
#include "core/ragged/planner.h"
#include "fsdp/fsdp_unit.h"
#include "optimizers/adamw/adamw.h"
#include "optimizers/common/param_shard.h"
#include "optimizers/common/tiles.h"
#include "optimizers/muon/muon.h"
#include "optimizers/shampoo/shampoo.h"
#include "optimizers/soap/soap.h"
#include "quant/ops.h"
#include "tests/cpp/test_util.h"
#include "tests/support/local_ranks.h"

namespace rfsdp {
namespace {

using testing::fresh_seed;
using testing::seeded_randn;

constexpr int kSteps = 5;
constexpr int64_t kTile = 16;       // Shampoo's and SOAP's max_preconditioner_dim
constexpr int64_t kBlock = 256;     // 8-bit blocks (AdamW8bit, Muon's momentum)
constexpr int64_t kMin8bit = 1024;  // AdamW8bit: smaller tensors keep fp32 moments

// The model: "embed" spans every rank of 8 and most of 32; "qkv" is 12 heads of
// 8 rows (Muon per block: each head its own matrix); "experts" is a [E, H, I]
// stack seen as E*H rows, so a plan may cut an expert between ranks; two vectors
// (AdamW's part of Muon, Adam's of Shampoo and SOAP) leave most of 32 ranks with
// nothing of them.
std::vector<TensorSpec> model_specs() {
  auto spec = [](std::string name, std::vector<int64_t> shape, int row_dims = 1) {
    TensorSpec t;
    t.name = std::move(name);
    t.shape = std::move(shape);
    t.row_dims = row_dims;
    return t;
  };
  return {spec("embed", {160, 32}), spec("qkv", {96, 32}),  spec("experts", {4, 24, 32}, 2),
          spec("out", {32, 96}),    spec("bias", {96}),     spec("norm", {32})};
}

bool is_matrix(const TensorSpec& t) { return t.shape.size() >= 2; }

enum class Layout { Planned, Chunks };

// One optimizer configuration: how the planner's granules follow it, and how
// a rank builds it over its shards.
struct Variant {
  std::string name;
  Layout layout = Layout::Planned;
  // The granule (rows) the optimizer asks of tensor t; none: 1 row (blocks and
  // tiles cut, shared by ranks or sent to their owners).
  std::function<int64_t(const TensorSpec&)> granule;
  bool per_block = false;  // qkv's heads are Muon blocks
  std::function<std::unique_ptr<ShardedOptimizer>(std::shared_ptr<Comm>, std::vector<ParamShard>)>
      make;
  bool exact = false;  // element-wise steps: bit for bit
};

int64_t eight_bit_granule(const TensorSpec& t) {
  return quant::BlockShape::blocks(kBlock).granule_rows(t.row_elems());
}
int64_t tile_granule(const TensorSpec& t) {
  return is_matrix(t) ? tile_granule_rows(t.shape, t.row_dims, kTile) : 1;
}

// qkv's 12 heads of 8 rows: Muon's blocks when a variant takes it per head.
std::vector<int64_t> qkv_heads() { return std::vector<int64_t>(12, 8); }

std::unique_ptr<ShardedOptimizer> make_muon(std::shared_ptr<Comm> comm, std::vector<ParamShard> ps,
                                            MuonOptions o, MuonConfig c, bool per_block) {
  std::vector<bool> use;
  std::vector<std::vector<int64_t>> split(ps.size());
  for (size_t i = 0; i < ps.size(); ++i) {
    use.push_back(ps[i].shape.size() >= 2);
    // Planned per-block shards carry the heads themselves (TensorSpec::blocks);
    // FSDP2's chunk rows name them.
    if (per_block && ps[i].name == "qkv" && ps[i].blocks.empty()) split[i] = qkv_heads();
  }
  return std::make_unique<Muon>(std::move(ps), o, std::move(c), std::move(comm), std::vector<int>{},
                                use, std::move(split));
}

ShampooConfig shampoo_config() {
  ShampooConfig c;
  c.max_preconditioner_dim = kTile;
  c.precondition_frequency = 2;
  c.start_preconditioning_step = 2;
  return c;
}

SOAPConfig soap_config() {
  SOAPConfig c;
  c.max_preconditioner_dim = kTile;
  c.precondition_frequency = 2;
  return c;
}

std::vector<Variant> variants() {
  std::vector<Variant> v;
  AdamWOptions adam;
  adam.lr = 1e-2;
  v.push_back({"AdamW", Layout::Planned, {}, false,
               [adam](auto comm, auto ps) { return std::make_unique<AdamW>(std::move(ps), adam, comm); },
               true});
  auto adamw8 = [adam](auto comm, auto ps) {
    AdamW8bitConfig config;
    config.block = quant::BlockShape::blocks(kBlock);
    config.min_8bit_size = kMin8bit;
    return std::make_unique<AdamW8bit>(std::move(ps), adam, config, comm);
  };
  v.push_back({"AdamW8bit", Layout::Planned, eight_bit_granule, false, adamw8, true});
  v.push_back({"AdamW8bitSharedBlocks", Layout::Planned, {}, false, adamw8, true});
  v.push_back({"AdamW8bitFsdp2Chunks", Layout::Chunks, {}, false, adamw8, true});

  MuonOptions muon;
  muon.lr = 1e-2;
  v.push_back({"Muon", Layout::Planned, {}, false,
               [muon](auto comm, auto ps) { return make_muon(comm, std::move(ps), muon, {}, false); }});
  v.push_back({"MuonPerHead", Layout::Planned, {}, true,
               [muon](auto comm, auto ps) { return make_muon(comm, std::move(ps), muon, {}, true); }});
  v.push_back({"MuonPerHeadFsdp2Chunks", Layout::Chunks, {}, true,
               [muon](auto comm, auto ps) { return make_muon(comm, std::move(ps), muon, {}, true); }});
  MuonConfig muon8;
  muon8.momentum_dtype = at::kByte;
  muon8.momentum_block = kBlock;
  v.push_back({"Muon8bitMomentum", Layout::Planned, eight_bit_granule, false, [muon, muon8](auto comm, auto ps) {
                 return make_muon(comm, std::move(ps), muon, muon8, false);
               }});

  ShampooOptions sh;
  sh.lr = 1e-2;
  auto shampoo = [sh](ShampooConfig c) {
    return [sh, c](auto comm, auto ps) {
      return std::make_unique<Shampoo>(std::move(ps), sh, c, comm);
    };
  };
  ShampooConfig sh8 = shampoo_config();
  sh8.basis.bits = 8;
  sh8.basis.block = 16;
  v.push_back({"Shampoo", Layout::Planned, tile_granule, false, shampoo(shampoo_config())});
  v.push_back({"ShampooCutTiles", Layout::Planned, {}, false, shampoo(shampoo_config())});
  v.push_back({"ShampooFsdp2Chunks", Layout::Chunks, {}, false, shampoo(shampoo_config())});
  v.push_back({"Shampoo8bitRoots", Layout::Planned, tile_granule, false, shampoo(sh8)});

  SOAPOptions so;
  so.lr = 1e-2;
  // Not 1e-8: m' / (sqrt(v) + eps) amplifies any rounding difference where m'
  // and v are both tiny (test_soap.cpp's comparison found it), should a BLAS
  // round a sharded run's rotation differently from one device's.
  so.eps = 1e-4;
  auto soap = [so](SOAPConfig c) {
    return [so, c](auto comm, auto ps) {
      return std::make_unique<SOAP>(std::move(ps), so, c, comm);
    };
  };
  SOAPConfig so8 = soap_config();
  so8.state_dtype = at::kByte;
  SOAPConfig sob = soap_config();
  sob.basis.bits = 8;
  sob.basis.block = 16;
  v.push_back({"SOAP", Layout::Planned, tile_granule, false, soap(soap_config())});
  v.push_back({"SOAPCutTiles", Layout::Planned, {}, false, soap(soap_config())});
  v.push_back({"SOAPFsdp2Chunks", Layout::Chunks, {}, false, soap(soap_config())});
  v.push_back({"SOAP8bitMoments", Layout::Planned, tile_granule, false, soap(so8)});
  v.push_back({"SOAP8bitMomentsCutTiles", Layout::Planned, {}, false, soap(so8)});
  v.push_back({"SOAP8bitMomentsFsdp2Chunks", Layout::Chunks, {}, false, soap(so8)});
  v.push_back({"SOAP8bitBases", Layout::Planned, tile_granule, false, soap(sob)});
  return v;
}

// The unit as variant v plans it for `world` ranks.
Plan plan_for(const Variant& v, int64_t world) {
  std::vector<TensorSpec> specs = model_specs();
  for (TensorSpec& t : specs) {
    if (v.per_block && t.name == "qkv") t.blocks = qkv_heads();
    t.granule_rows = t.blocks.empty() ? 1 : block_granule_rows(t.name, t.shape, t.row_dims, t.blocks);
    if (v.granule) t.granule_rows = combine_granules(t.granule_rows, v.granule(t), t.rows());
  }
  return plan_unit(specs, world, 16);
}

at::Tensor grad_of(const TensorSpec& t, uint64_t seed, int step, size_t i) {
  return seeded_randn(t.shape, seed, 100 * static_cast<uint64_t>(step) + i);
}

// Every rank's rows of every parameter after kSteps (rows[rank][i]).
using RankRows = std::vector<std::vector<at::Tensor>>;

// The planner's layout over `world` ranks as HSDP groups of shard_size: an
// FSDPUnit per rank, each step's gradient reduced from pieces every rank of the
// world adds (element k from rank k mod world, so the sum is exact), then the
// optimizer over the shard group.
RankRows run_planned(const Variant& v, int world, int shard_size, uint64_t seed) {
  const Plan plan = plan_for(v, shard_size);
  const std::vector<TensorSpec> specs = model_specs();
  RankRows rows(world);
  std::mutex mu;
  run_local_ranks(world, [&](Comm& c) {
    // One shard group of the whole world is plain FSDP: the world's comm itself
    // (no second group of as many ranks to set up).
    HybridGroups g = shard_size == world
                         ? HybridGroups{std::shared_ptr<Comm>(&c, [](Comm*) {}), nullptr}
                         : hybrid_groups(c, shard_size);
    FSDPUnit unit(g.shard, g.replicate, plan);
    std::vector<at::Tensor> full;
    for (size_t i = 0; i < specs.size(); ++i) full.push_back(seeded_randn(specs[i].shape, seed, i));
    unit.shard(full);
    auto opt = v.make(g.shard, param_shards(unit));
    for (int s = 0; s < kSteps; ++s) {
      unit.unshard().wait();
      unit.prepare_grads();
      for (size_t i = 0; i < specs.size(); ++i) {
        const at::Tensor gfull = grad_of(specs[i], seed, s, i).reshape(-1);
        const at::Tensor mine =
            at::arange(gfull.numel(), at::kLong).remainder(world).eq(c.rank()).to(at::kFloat);
        unit.full_grad(i).reshape(-1).copy_(gfull * mine);
      }
      unit.reduce_grads(ReduceOp::Sum).wait();
      opt->step();
      unit.zero_grad();
      unit.reshard();
    }
    std::vector<at::Tensor> mine;
    for (size_t i = 0; i < specs.size(); ++i) mine.push_back(unit.local_param(i).clone());
    std::lock_guard<std::mutex> lock(mu);
    rows[c.rank()] = std::move(mine);
  });
  return rows;
}

// FSDP2's layout: every tensor's dim 0 split as torch.chunk splits it.
RankRows run_chunks(const Variant& v, int world, uint64_t seed) {
  const std::vector<TensorSpec> specs = model_specs();
  RankRows rows(world);
  std::mutex mu;
  run_local_ranks(world, [&](Comm& c) {
    auto comm = std::shared_ptr<Comm>(&c, [](Comm*) {});
    std::vector<ParamShard> ps;
    for (size_t i = 0; i < specs.size(); ++i) {
      const TensorSpec& t = specs[i];
      const int64_t d0 = t.shape[0], per_d0 = t.rows() / d0, c0 = (d0 + world - 1) / world;
      std::vector<std::pair<int64_t, int64_t>> every;
      for (int r = 0; r < world; ++r) {
        every.push_back({std::min(r * c0, d0) * per_d0, std::min((r + 1) * c0, d0) * per_d0});
      }
      const auto [b, e] = every[c.rank()];
      const at::Tensor full = seeded_randn(t.shape, seed, i).reshape(-1);
      ps.emplace_back(TensorShard::rows_of(t.name, t.shape, t.row_dims, b, e, every),
                      full.narrow(0, b * t.row_elems(), (e - b) * t.row_elems()).clone(),
                      at::zeros({(e - b) * t.row_elems()}));
    }
    auto opt = v.make(comm, ps);  // the shards' tensors are the optimizer's
    for (int s = 0; s < kSteps; ++s) {
      for (size_t i = 0; i < specs.size(); ++i) {
        const at::Tensor g = grad_of(specs[i], seed, s, i).reshape(-1);
        ps[i].grad.copy_(g.narrow(0, ps[i].row_begin * ps[i].row_len, ps[i].numel()));
      }
      opt->step();
    }
    std::vector<at::Tensor> mine;
    for (const auto& p : ps) mine.push_back(p.param.clone());
    std::lock_guard<std::mutex> lock(mu);
    rows[c.rank()] = std::move(mine);
  });
  return rows;
}

// Every parameter, whole, from the ranks of one shard group (its first
// `shard_size` ranks, in order: what run_planned's groups hold).
std::vector<at::Tensor> assemble(const RankRows& rows, int first, int count) {
  std::vector<at::Tensor> full;
  for (size_t i = 0; i < rows[first].size(); ++i) {
    std::vector<at::Tensor> pieces;
    for (int r = first; r < first + count; ++r) pieces.push_back(rows[r][i].reshape(-1));
    full.push_back(at::cat(pieces));
  }
  return full;
}

struct Mesh {
  int world, shard_size;
};

// What a failure prints of its parameters.
void PrintTo(const Variant& v, std::ostream* os) { *os << v.name; }
void PrintTo(const Mesh& m, std::ostream* os) {
  *os << m.world << " ranks in shard groups of " << m.shard_size;
}

class ManyRanks : public ::testing::TestWithParam<std::tuple<Variant, Mesh>> {};

TEST_P(ManyRanks, EveryRanksRowsEqualOneDevice) {
  const auto& [v, mesh] = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<TensorSpec> specs = model_specs();
  const std::vector<at::Tensor> one = assemble(run_planned(v, 1, 1, seed), 0, 1);
  RankRows rows;
  if (v.layout == Layout::Chunks) {
    rows = run_chunks(v, mesh.world, seed);
  } else {
    rows = run_planned(v, mesh.world, mesh.shard_size, seed);
    // The plan is the kind the suite is for: "embed" spans several ranks, ranks
    // hold nothing of some tensor, and where the variant asks no granule of the
    // expert stack a rank boundary falls inside an expert.
    const Plan plan = plan_for(v, mesh.shard_size);
    const size_t embed = 0, experts = 2;
    int embed_ranks = 0;
    bool empty = false, expert_cut = false;
    for (int r = 0; r < mesh.shard_size; ++r) {
      for (size_t i = 0; i < specs.size(); ++i) empty |= plan.shard(i, r).numel == 0;
      embed_ranks += plan.shard(embed, r).numel > 0;
      const ShardRange e = plan.shard(experts, r);
      expert_cut |= e.numel > 0 && (e.row_begin % 24 != 0 || e.row_end % 24 != 0);
    }
    EXPECT_TRUE(empty);
    EXPECT_GE(embed_ranks, std::min(3, mesh.shard_size / 2));
    if (!v.granule) {
      std::string where;
      for (int r = 0; r < mesh.shard_size; ++r) {
        for (size_t i = 0; i < specs.size(); ++i) {
          const ShardRange e = plan.shard(i, r);
          where += " " + specs[i].name + "@" + std::to_string(r) + ":" + std::to_string(e.row_begin) + "-" + std::to_string(e.row_end);
        }
      }
      EXPECT_TRUE(expert_cut) << where;
    }
  }
  // Where the groups are rank-major (hybrid_groups: shard group k is ranks
  // k*shard_size ...), every replica holds what the first does.
  for (int first = 0; first < mesh.world; first += mesh.shard_size) {
    const std::vector<at::Tensor> got = assemble(rows, first, mesh.shard_size);
    for (size_t i = 0; i < specs.size(); ++i) {
      const at::Tensor want = one[i], have = got[i];
      ASSERT_EQ(have.numel(), want.numel()) << specs[i].name;
      if (v.exact) {
        ASSERT_TRUE(at::equal(have, want))
            << specs[i].name << ": max |diff| " << (have - want).abs().max().item<double>()
            << " (replica from rank " << first << ")";
      } else {
        // lr 1e-2 and 5 steps: a wrong row, block or tile moves an element by
        // ~1e-3..1e-2; fp32 rounding of the same computation by far less.
        ASSERT_TRUE(at::allclose(have, want, 1e-5, 1e-6))
            << specs[i].name << ": max |diff| " << (have - want).abs().max().item<double>()
            << " (replica from rank " << first << ")";
      }
    }
  }
  // The run moved every parameter away from where it started.
  for (size_t i = 0; i < specs.size(); ++i) {
    EXPECT_FALSE(at::equal(one[i], seeded_randn(specs[i].shape, seed, i).reshape(-1))) << specs[i].name;
  }
}

std::vector<Mesh> meshes() { return {{8, 8}, {16, 16}, {32, 32}, {16, 4}, {16, 8}}; }

std::string param_name(const ::testing::TestParamInfo<std::tuple<Variant, Mesh>>& info) {
  const auto& [v, m] = info.param;
  const std::string mesh = m.world == m.shard_size
                               ? std::to_string(m.world) + "ranks"
                               : "hsdp" + std::to_string(m.world / m.shard_size) + "x" +
                                     std::to_string(m.shard_size);
  return v.name + "_" + mesh;
}

// FSDP2's chunk rows make no HSDP mesh here (their runs are plain FSDP): their
// variants run on the plain worlds only.
std::vector<std::tuple<Variant, Mesh>> cases() {
  std::vector<std::tuple<Variant, Mesh>> out;
  for (const Variant& v : variants()) {
    for (const Mesh& m : meshes()) {
      if (v.layout == Layout::Chunks && m.world != m.shard_size) continue;
      out.emplace_back(v, m);
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Scale, ManyRanks, ::testing::ValuesIn(cases()), param_name);

}  // namespace
}  // namespace rfsdp
