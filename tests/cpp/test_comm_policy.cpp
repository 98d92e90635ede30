// CommPolicy on FSDPUnit, ranks as threads: weights gathered as int8 / float8
// block codes equal the blocks of the global tensor quantised alone (one rank's
// encoding of the whole tensor, its rounding checked in float64), on 1-4 ranks
// and several flat buffers; bf16 gradients summed in fp32 in rank order; a
// plan that cuts a block is refused naming the tensor.
#include <gtest/gtest.h>

#include <numeric>
#include <random>

#include "core/ragged/planner.h"
#include "core/ragged/step_model.h"
#include "fsdp/fsdp_unit.h"
#include "quant/ops.h"
#include "tests/cpp/test_util.h"
#include "tests/support/local_ranks.h"

namespace rfsdp {
namespace {

using testing::fresh_seed;
using testing::seeded_randn;

constexpr int64_t kBlock = 32;

// Matrices of row lengths 7 and 12 and a bias; granules that keep kBlock-element
// blocks whole (the 8-bit granule), or 1 row (which cuts blocks on 2+ ranks).
std::vector<TensorSpec> unit_specs(bool block_granule) {
  std::vector<TensorSpec> unit;
  for (auto [name, shape] : {std::pair<const char*, std::vector<int64_t>>{"a", {96, 7}},
                             {"bias", {45}}, {"b", {40, 12}}}) {
    TensorSpec t;
    t.name = name;
    t.shape = shape;
    t.granule_rows = block_granule ? quant::BlockShape::blocks(kBlock).granule_rows(t.row_elems()) : 1;
    unit.push_back(t);
  }
  return unit;
}

Plan plan_for(int world, bool several_buffers) {
  PlannerOptions o;
  if (several_buffers) o.collective_cost_bytes = 0;  // as many buffers as pay
  return plan_unit(unit_specs(true), world, 16, o);
}

// The global tensor's blocks quantised by one rank that holds all of it, decoded
// to code * scale in fp32; every element within half a code step (int8) or half
// an e4m3 ulp of its weight, in float64.
at::Tensor reference(const at::Tensor& w, const CommPolicy& p) {
  const at::Tensor x = w.reshape(-1).contiguous();
  const int64_t n = x.numel(), nb = (n + kBlock - 1) / kBlock;
  at::Tensor codes = at::empty({n}, x.options().dtype(p.code_dtype()));
  at::Tensor scales = at::empty({nb}, x.options());
  QuantizedGather::encode_piece(x, kBlock, p, codes, scales);
  const at::Tensor s = scales.repeat_interleave(kBlock).narrow(0, 0, n);
  const at::Tensor out = codes.to(at::kFloat) * s;
  const at::Tensor err = (out.to(at::kDouble) - x.to(at::kDouble)).abs();
  const at::Tensor bound = p.weights == WeightWire::kInt8
                               ? s.to(at::kDouble) * 0.5
                               : at::maximum(x.to(at::kDouble).abs() / 16, s.to(at::kDouble) / 1024);
  // (+ 1e-4 of a scale: x / scale is rounded in fp32 before its code, up to 448 * 2^-24 off)
  EXPECT_TRUE((err <= bound + s.to(at::kDouble) * 1e-4 + 1e-30).all().item<bool>())
      << "the encoding rounds wrongly";
  return out.view(w.sizes());
}

class CommPolicyWorld : public ::testing::TestWithParam<int> {};

TEST_P(CommPolicyWorld, GatheredWeightsAreTheGlobalBlocksQuantisedAlone) {
  const int world = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (bool several : {false, true}) {
    const Plan plan = plan_for(world, several);
    if (several && world == 4) ASSERT_GT(plan.num_buffers(), 1u);
    for (const char* fmt : {"int8", "float8_e4m3fn"}) {
      const CommPolicy policy = CommPolicy::parse(fmt, kBlock, std::nullopt);
      std::vector<at::Tensor> full;
      for (size_t i = 0; i < plan.tensors.size(); ++i) {
        full.push_back(seeded_randn(plan.tensors[i].shape, seed, i) * (i + 1));
      }
      full[1].narrow(0, 0, kBlock).zero_();  // a block of zeros: scale 0, codes 0
      for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
        run_local_ranks(world, [&](Comm& c) {
          auto comm = std::shared_ptr<Comm>(&c, [](Comm*) {});
          FSDPUnit unit(comm, nullptr, plan, MixedPrecision{dt, at::kFloat}, policy);
          unit.shard(full);
          for (int round = 0; round < 2; ++round) {
            unit.unshard().wait();
            for (size_t i = 0; i < full.size(); ++i) {
              ASSERT_TRUE(at::equal(unit.full_param(i), reference(full[i], policy).to(dt)))
                  << fmt << " tensor " << plan.tensors[i].name << " rank " << c.rank();
            }
            unit.reshard();
          }
          // codes (1 byte an element of the slice) and one fp32 scale a block
          EXPECT_LE(unit.gather_bytes_sent(), (world - 1) * plan.shard_elems * 2);
        });
      }
    }
  }
}

TEST_P(CommPolicyWorld, Bf16GradientsAreSummedInFp32InRankOrder) {
  const int world = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (bool several : {false, true}) {
    const Plan plan = plan_for(world, several);
    const CommPolicy policy = CommPolicy::parse(std::nullopt, 256, at::kBFloat16);
    auto grads = [&](int r, size_t i) { return seeded_randn(plan.tensors[i].shape, seed, 100 * r + i); };
    run_local_ranks(world, [&](Comm& c) {
      auto comm = std::shared_ptr<Comm>(&c, [](Comm*) {});
      FSDPUnit unit(comm, nullptr, plan, MixedPrecision{}, policy);
      unit.shard({grads(90, 0), grads(90, 1), grads(90, 2)});
      for (int pass = 0; pass < 2; ++pass) {  // the second adds to the first (accumulation)
        unit.prepare_grads();
        for (size_t i = 0; i < plan.tensors.size(); ++i) unit.full_grad(i).copy_(grads(c.rank() + 10 * pass, i));
        unit.reduce_grads().wait();
      }
      for (size_t i = 0; i < plan.tensors.size(); ++i) {
        at::Tensor want;
        for (int pass = 0; pass < 2; ++pass) {
          at::Tensor acc = grads(10 * pass, i).to(at::kBFloat16).to(at::kFloat);
          for (int r = 1; r < world; ++r) acc = acc + grads(r + 10 * pass, i).to(at::kBFloat16).to(at::kFloat);
          acc = acc / world;
          want = pass == 0 ? acc : want + acc;
        }
        const ShardRange s = unit.shard_range(i);
        const at::Tensor mine = want.reshape(-1).narrow(0, s.row_begin * plan.tensors[i].row_elems(), s.numel);
        ASSERT_TRUE(at::equal(unit.local_grad(i).reshape(-1), mine))
            << "tensor " << plan.tensors[i].name << " rank " << c.rank();
      }
    });
  }
}

TEST_P(CommPolicyWorld, ModelledBytesEqualWhatCommCounts) {
  // core/ragged/step_model.h's bytes per rank (what rfsdp-plan --report and the
  // benches print) against the payload Comm counts in one gather and one gradient
  // reduction: a gather counts this rank's slice (sent to m - 1 others), a
  // reduce-scatter the whole buffer (m - 1 of its m slices leave), an all-to-all
  // exactly what leaves. Full precision, bf16 weights, int8 codes with fp32 and bf16
  // gradients; one buffer and several.
  const int world = GetParam();
  if (world < 2) GTEST_SKIP() << "one rank sends nothing";
  if (world > 8) GTEST_SKIP() << "2 to 8 ranks check it (16 and 32 cost 20 s and check nothing more)";
  const uint64_t seed = fresh_seed();
  for (bool several : {false, true}) {
    const Plan plan = plan_for(world, several);
    struct Case {
      const char* name;
      MixedPrecision mp;
      CommPolicy policy;
    };
    const Case cases[] = {
        {"fp32", MixedPrecision{at::kFloat, at::kFloat}, CommPolicy{}},
        {"bf16 weights", MixedPrecision{at::kBFloat16, at::kFloat}, CommPolicy{}},
        {"int8 / fp32", MixedPrecision{}, CommPolicy::parse("int8", kBlock, std::nullopt)},
        {"int8 / bf16", MixedPrecision{}, CommPolicy::parse("int8", kBlock, at::kBFloat16)}};
    for (const Case& k : cases) {
      SCOPED_TRACE(std::string(k.name) + (several ? ", several buffers" : ", one buffer"));
      std::vector<at::Tensor> full;
      for (size_t i = 0; i < plan.tensors.size(); ++i) full.push_back(seeded_randn(plan.tensors[i].shape, seed, i));
      run_local_ranks(world, [&](Comm& c) {
        auto comm = std::shared_ptr<Comm>(&c, [](Comm*) {});
        FSDPUnit unit(comm, nullptr, plan, k.mp, k.policy);
        unit.shard(full);
        const WireFormat wire = unit.wire_format();
        const int64_t m = world;
        int64_t before = c.stats().bytes_sent;
        unit.unshard().wait();
        const int64_t gathered = c.stats().bytes_sent - before;
        EXPECT_EQ(gathered * (m - 1), gather_bytes(plan, wire)) << wire.describe();
        EXPECT_EQ(unit.gather_bytes_sent(), gather_bytes(plan, wire));
        unit.prepare_grads();
        for (size_t i = 0; i < plan.tensors.size(); ++i) unit.full_grad(i).copy_(full[i]);
        before = c.stats().bytes_sent;
        unit.reduce_grads().wait();
        const int64_t reduced = c.stats().bytes_sent - before;
        if (k.policy.gradients) {  // an all-to-all: what leaves
          EXPECT_EQ(reduced, reduce_bytes(plan, wire)) << wire.describe();
        } else {  // reduce-scatters: the buffers
          EXPECT_EQ(reduced * (m - 1), reduce_bytes(plan, wire) * m) << wire.describe();
        }
        EXPECT_EQ(unit.reduce_bytes_sent(), reduce_bytes(plan, wire));
      });
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, CommPolicyWorld, ::testing::Values(1, 2, 3, 4, 8, 16, 32));

// Values that test the roundings: ties of int8 steps (k + 1/2 of a scale), e4m3's
// subnormals and its ties, zeros and -0, a block of zeros, huge and tiny magnitudes.
at::Tensor hard_values(int64_t n, uint64_t seed) {
  at::Tensor x = seeded_randn({n}, seed, 1);
  x.narrow(0, 0, 64).zero_();
  x[64] = -0.0f;
  std::mt19937_64 rng(seed);
  for (int64_t i = 65; i < n; ++i) {
    switch (rng() % 6) {
      case 0: x[i] = x[i].item<float>() * 1e-6f; break;                  // subnormal e4m3 codes
      case 1: x[i] = (static_cast<int>(rng() % 255) - 127) + 0.5f; break;  // int8 ties (absmax 127.5)
      case 2: x[i] = x[i].item<float>() * 1e30f; break;
      case 3: x[i] = x[i].item<float>() * 1e-30f; break;
      default: break;
    }
  }
  return x;
}

TEST(CommPolicy, CpuKernelsEqualTheGenericPathBitForBit) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const char* fmt : {"int8", "float8_e4m3fn"}) {
    for (int64_t block : {1, 7, 32, 256}) {
      const CommPolicy p = CommPolicy::parse(fmt, block, std::nullopt);
      const int64_t n = 4099;
      const at::Tensor x = hard_values(n, seed + block);
      const int64_t nb = (n + block - 1) / block;
      at::Tensor codes[2], scales[2];
      for (int generic = 0; generic < 2; ++generic) {
        quant::use_device_generic_path(generic == 1);
        codes[generic] = at::empty({n}, x.options().dtype(p.code_dtype()));
        scales[generic] = at::empty({nb}, x.options());
        QuantizedGather::encode_piece(x, block, p, codes[generic], scales[generic]);
      }
      EXPECT_TRUE(at::equal(scales[0], scales[1])) << fmt << " block " << block;
      EXPECT_TRUE(at::equal(codes[0].view(at::kByte), codes[1].view(at::kByte))) << fmt << " block " << block;
      for (at::ScalarType dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
        at::Tensor out[2];
        for (int generic = 0; generic < 2; ++generic) {
          quant::use_device_generic_path(generic == 1);
          out[generic] = at::empty({n}, x.options().dtype(dt));
          QuantizedGather::decode_piece(codes[0], scales[0], block, p, out[generic]);
        }
        EXPECT_TRUE(at::equal(out[0].view({-1}).to(at::kFloat), out[1].view({-1}).to(at::kFloat)))
            << fmt << " block " << block << " " << dt;
      }
      quant::use_device_generic_path(false);
    }
  }
}

TEST(CommPolicy, APlanThatCutsABlockIsRefusedNamingTheTensor) {
  const Plan plan = plan_unit(unit_specs(false), 3, 16);
  const CommPolicy policy = CommPolicy::parse("int8", kBlock, std::nullopt);
  try {
    policy.check_plan(plan);
    FAIL() << "a plan with 1-row granules on 3 ranks cuts a block of " << kBlock;
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("inside a block of 32"), std::string::npos) << m;
    EXPECT_NE(m.find("blockwise_8bit(32)"), std::string::npos) << m;
    EXPECT_TRUE(m.find("tensor 'a'") != std::string::npos || m.find("tensor 'b'") != std::string::npos ||
                m.find("tensor 'bias'") != std::string::npos) << m;
  }
  EXPECT_NO_THROW(policy.check_plan(plan_for(3, false)));
  EXPECT_NO_THROW(CommPolicy::parse(std::nullopt, 256, at::kBFloat16).check_plan(plan));  // no codes
  EXPECT_THROW(CommPolicy::parse("int4", 256, std::nullopt), std::invalid_argument);
  EXPECT_THROW(CommPolicy::parse("int8", 0, std::nullopt), std::invalid_argument);
  EXPECT_THROW(CommPolicy::parse(std::nullopt, 256, at::kHalf), std::invalid_argument);
}

}  // namespace
}  // namespace rfsdp
