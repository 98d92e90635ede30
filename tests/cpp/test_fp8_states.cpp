// The float8_e4m3fn state format (quant/formats/fp8_e4m3.h): its encode and
// decode against torch's cast bit for bit (every float of a range, ties and
// subnormals included), through every CPU kernel set and the device-generic
// path; and the kernel sets' AdamW and momentum steps against each other bit
// for bit, the two-half step of cut blocks against the fused one.
#include <gtest/gtest.h>

#include <ATen/Context.h>
#include <c10/util/Float8_e4m3fn.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "quant/formats/fp8_e4m3.h"
#include "quant/ops.h"
#include "tests/cpp/quant_isas.h"
#include "tests/cpp/test_util.h"

namespace rfsdp::quant {
namespace {

using testing::float_of;
using testing::fresh_seed;

uint8_t torch_cast(float y) { return c10::Float8_e4m3fn(y).x; }

// The float bit patterns the kernel tests walk: every magnitude below 464 whose
// low 12 bits are one of a few that hold the ties (low bits 0: a subnormal
// tie is a multiple of 2^-10, a normal one has its low 20 bits 0x80000) and
// their neighbours, both signs.
std::vector<float> tie_rich_floats(uint64_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::vector<float> out;
  const uint32_t top = 0x43E80000u >> 12;  // 464
  for (uint32_t hi = 0; hi < top; ++hi) {
    for (uint32_t lo : {0u, 1u, 0x7FFu, 0x800u, 0x801u, 0xFFFu, static_cast<uint32_t>(rng() & 0xFFFu)}) {
      const uint32_t b = (hi << 12) | lo;
      out.push_back(float_of(b));
      out.push_back(float_of(b | 0x80000000u));
    }
  }
  return out;
}

// tie_rich_floats of magnitude up to 448 in blocks of 256 that start with 448, so
// the block's scale 448 / 448 is 1 and a value's code is its own cast.
std::vector<float> tie_rich_blocks(uint64_t seed) {
  std::vector<float> vals;
  for (float y : tie_rich_floats(seed)) {
    if (std::fabs(y) > 448.0f) continue;
    if (vals.size() % 256 == 0) vals.push_back(448.0f);
    vals.push_back(y);
  }
  return vals;
}

// check(what) on every CPU kernel set, then on the device-generic path.
template <class F>
void on_every_path(F&& check) {
  testing::for_each_quant_isa([&](cpu::Isa) { check("cpu kernels"); });
  use_device_generic_path(true);
  check("device-generic path");
  use_device_generic_path(false);
}

TEST(Fp8Format, EncodeEqualsTorchsCastOnEveryFloatBelow464) {
  // RFSDP_EXHAUSTIVE=1: every float of magnitude below 464 (1.1e9, seconds), else
  // a fresh 1/97 of them and all the tie-rich patterns.
  const bool all = std::getenv("RFSDP_EXHAUSTIVE") != nullptr;
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const uint32_t stride = all ? 1 : 97, start = all ? 0 : static_cast<uint32_t>(seed % 97);
  int64_t bad = 0;
  for (uint32_t b = start; b < 0x43E80000u; b += stride) {
    const float y = float_of(b);
    if (fp8::encode(y, false) != torch_cast(y) || fp8::encode(-y, false) != torch_cast(-y)) {
      if (++bad < 5) ADD_FAILURE() << "bits 0x" << std::hex << b;
    }
  }
  for (float y : tie_rich_floats(seed)) {
    if (fp8::encode(y, false) != torch_cast(y) && ++bad < 10) ADD_FAILURE() << y;
  }
  EXPECT_EQ(bad, 0);
  // the ties themselves, by name: 0.5 ulp of the subnormal step, and of a normal binade
  EXPECT_EQ(fp8::encode(float_of(0x3A800000u), false), 0u);       // 2^-10: tie 0 | 1, even 0
  EXPECT_EQ(fp8::encode(3 * 0.0009765625f, false), 2u);           // 3 * 2^-10: tie 1 | 2 -> 2
  EXPECT_EQ(fp8::encode(1.0625f, false), torch_cast(1.0625f));    // 1 + 1/16: tie -> 1.0
  EXPECT_EQ(fp8::encode(1.0625f, false), 0x38u);
}

TEST(Fp8Format, DecodeEqualsTorchsValuesOfEveryCode) {
  for (int q = 0; q < 256; ++q) {
    if ((q & 0x7F) == 0x7F) continue;  // NaN
    const float want = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(q), c10::Float8_e4m3fn::from_bits()));
    const float got = fp8::decode(static_cast<uint8_t>(q));
    uint32_t a, b;
    std::memcpy(&a, &want, 4);
    std::memcpy(&b, &got, 4);
    EXPECT_EQ(a, b) << "code " << q;
  }
}

TEST(Fp8Format, KeepNonzeroGivesEveryValueAbove0ACode) {
  EXPECT_EQ(fp8::encode(0.0f, true), 0u);
  EXPECT_EQ(fp8::encode(1e-30f, true), 1u);
  EXPECT_EQ(fp8::encode(float_of(1), true), 1u);
  EXPECT_EQ(fp8::encode(0.0009765625f, true), 1u);  // the tie to 0
  EXPECT_EQ(fp8::encode(-1e-30f, true), 0x80u);      // (v is never negative: as the cast)
  EXPECT_EQ(fp8::encode(0.5f, true), torch_cast(0.5f));
}

// tie_rich_blocks: the kernels' codes against torch's, and back.
TEST(Fp8Format, EveryKernelSetAndTheGenericPathCodeAsTorchsCast) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::vector<float> vals = tie_rich_blocks(seed);
  const at::Tensor x = at::from_blob(vals.data(), {static_cast<int64_t>(vals.size())}, at::kFloat).clone();
  const at::Tensor want = x.to(at::kFloat8_e4m3fn).view(at::kByte);
  const at::Tensor back = want.view(at::kFloat8_e4m3fn).to(at::kFloat);
  const BlockLayout L(BlockShape::blocks(256), 1, x.numel());
  auto check = [&](const char* what) {
    SCOPED_TRACE(what);
    const at::Tensor q = at::empty_like(want), a = at::empty({L.num_blocks});
    ASSERT_TRUE(quantize(x, L, Codec::float8_e4m3(false), q, a));
    EXPECT_TRUE(a.eq(448.0f).all().item<bool>());
    EXPECT_EQ(q.ne(want).sum().item<int64_t>(), 0);
    const at::Tensor out = at::empty_like(x);
    dequantize(q, a, L, Codec::float8_e4m3(false), out);
    EXPECT_TRUE(out.view(at::kInt).equal(back.view(at::kInt)));
  };
  on_every_path(check);
}

// keep_nonzero (v's codes) on values of both signs, ties and subnormals included:
// every kernel set codes as the scalar rule (fp8::encode), which the vector sets
// write another way (cpu/fp8_blocks.inc's codes_of).
TEST(Fp8Format, KeepNonzeroCodesEqualTheScalarRuleOnEveryKernelSet) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::vector<float> vals = tie_rich_blocks(seed);
  std::vector<uint8_t> want;
  for (float y : vals) want.push_back(fp8::encode(y, true));
  const int64_t n = static_cast<int64_t>(vals.size());
  const at::Tensor x = at::from_blob(vals.data(), {n}, at::kFloat).clone();
  const at::Tensor expect = at::from_blob(want.data(), {n}, at::kByte).clone();
  const BlockLayout L(BlockShape::blocks(256), 1, n);
  auto check = [&](const char* what) {
    SCOPED_TRACE(what);
    const at::Tensor q = at::empty({n}, at::kByte), a = at::empty({L.num_blocks});
    ASSERT_TRUE(quantize(x, L, Codec::float8_e4m3(true), q, a));
    EXPECT_EQ(q.ne(expect).sum().item<int64_t>(), 0);
  };
  on_every_path(check);
}

// A block holding NaN or Inf (quantize reports it; Muon's momentum step stores such
// codes all the same): every kernel set writes the portable set's bytes, the NaN
// lanes' codes too (a NaN's code is above 255: the scalar cast keeps its low byte).
TEST(Fp8Format, BlocksWithNaNOrInfCodeAlikeOnEveryKernelSet) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const int64_t n = 1000;  // blocks of 256: whole vectors, fours of them, and a tail
  at::Tensor x = at::randn({n}, gen);
  for (int64_t at : {3, 70, 200, 255, 300, 513, 999}) x[at] = NAN;
  for (int64_t at : {5, 600}) x[at] = INFINITY;
  x[777] = -INFINITY;
  const BlockLayout L(BlockShape::blocks(256), 1, n);
  auto run = [&](bool keep_nonzero) {
    const at::Tensor q = at::empty({n}, at::kByte), a = at::empty({L.num_blocks});
    EXPECT_FALSE(quantize(x, L, Codec::float8_e4m3(keep_nonzero), q, a));
    return q;
  };
  for (bool keep_nonzero : {false, true}) {
    cpu::use_isa(cpu::Isa::kPortable);
    const at::Tensor want = run(keep_nonzero);
    testing::for_each_quant_isa([&](cpu::Isa) { EXPECT_TRUE(run(keep_nonzero).equal(want)); });
  }
}

// The vector sets decode through the CPU's fp16 conversion (cpu/fp8_blocks.inc),
// which must ignore MXCSR's denormals-are-zero (torch.set_flush_denormal(True)
// sets it): every code at scale 1 (absmax 448) decodes to torch's value in that
// mode too, the subnormal codes (e4m3's 2^-9 .. 7 * 2^-9) above all.
TEST(Fp8Format, EveryKernelSetDecodesEveryCodeWithDenormalsFlushed) {
  std::vector<uint8_t> codes;  // each code four times, in four orders
  for (int rep = 0; rep < 4; ++rep) {
    for (int k = 0; k < 256; ++k) {
      const int c = (k + 37 * rep) & 0xFF;
      if ((c & 0x7F) != 0x7F) codes.push_back(static_cast<uint8_t>(c));  // not NaN
    }
  }
  const int64_t n = static_cast<int64_t>(codes.size());
  const at::Tensor q = at::from_blob(codes.data(), {n}, at::kByte).clone();
  const at::Tensor want = q.view(at::kFloat8_e4m3fn).to(at::kFloat);
  const BlockLayout L(BlockShape::blocks(256), 1, n);
  const at::Tensor a = at::full({L.num_blocks}, 448.0f);
  // (4 blocks, below one task's grain: the kernels run on this thread, whose MXCSR
  // the mode sets)
  ASSERT_LT(L.num_blocks, 16);
  if (!at::globalContext().setFlushDenormal(true)) GTEST_SKIP() << "no flush-denormal mode here";
  at::globalContext().setFlushDenormal(false);
  struct FlushDenormals {
    FlushDenormals() { at::globalContext().setFlushDenormal(true); }
    ~FlushDenormals() { at::globalContext().setFlushDenormal(false); }
  };
  auto check = [&](const char* what) {
    SCOPED_TRACE(what);
    const at::Tensor out = at::empty({n});
    {
      FlushDenormals flushed;
      dequantize(q, a, L, Codec::float8_e4m3(false), out);
    }
    EXPECT_TRUE(out.view(at::kInt).equal(want.view(at::kInt)));
  };
  on_every_path(check);
}

// Random state and gradients over layouts with partial blocks and tiles.
struct Case {
  BlockShape shape;
  int64_t rows, row_len;
};
std::vector<Case> cases() {
  return {{BlockShape::blocks(256), 1, 1000},     {BlockShape::blocks(64), 7, 61},
          {BlockShape::blocks(4096), 3, 3001},    {BlockShape::tiles(32, 32), 70, 45},
          {BlockShape::tiles(2, 8), 5, 33},       {BlockShape::blocks(17), 1, 5}};
}

struct State {
  at::Tensor p, q1, a1, q2, a2;
  State clone() const { return {p.clone(), q1.clone(), a1.clone(), q2.clone(), a2.clone()}; }
  bool equal(const State& o) const {
    return p.view(at::kInt).equal(o.p.view(at::kInt)) && q1.equal(o.q1) && q2.equal(o.q2) &&
           a1.view(at::kInt).equal(o.a1.view(at::kInt)) && a2.view(at::kInt).equal(o.a2.view(at::kInt));
  }
};

State fresh(const BlockLayout& L, at::Generator& gen) {
  State s;
  s.p = at::randn({L.numel}, gen);
  // moments with scales over many binades (v: tiny to large), through the format itself
  const at::Tensor m = at::randn({L.numel}, gen) * at::pow(10.0, at::randint(-6, 1, {L.numel}, gen));
  const at::Tensor v = at::randn({L.numel}, gen).square_() * at::pow(10.0, at::randint(-12, 0, {L.numel}, gen));
  s.q1 = at::empty({L.numel}, at::kByte);
  s.q2 = at::empty({L.numel}, at::kByte);
  s.a1 = at::empty({L.num_blocks});
  s.a2 = at::empty({L.num_blocks});
  EXPECT_TRUE(quantize(m.to(at::kFloat), L, Codec::float8_e4m3(false), s.q1, s.a1));
  EXPECT_TRUE(quantize(v.to(at::kFloat), L, Codec::float8_e4m3(true), s.q2, s.a2));
  return s;
}

TEST(Fp8States, AdamWStepEqualsOnEveryKernelSetAndTheGenericPath) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Codec c1 = Codec::float8_e4m3(false), c2 = Codec::float8_e4m3(true);
  for (const Case& k : cases()) {
    SCOPED_TRACE(k.shape.str() + " over " + std::to_string(k.rows) + "x" + std::to_string(k.row_len));
    const BlockLayout L(k.shape, k.rows, k.row_len);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    const State start = fresh(L, gen);
    std::vector<at::Tensor> grads;
    for (int i = 0; i < 3; ++i) grads.push_back(at::randn({L.numel}, gen) * 1e-2);
    auto run = [&](bool halves) {
      State s = start.clone();
      for (int i = 0; i < 3; ++i) {
        const AdamWHyper h{1e-2f, 0.9f, 0.99f, 1e-8f, 0.1f, i + 1};
        if (!halves) {
          adamw8bit_step(s.p, grads[i], s.q1, s.a1, s.q2, s.a2, L, c1, c2, h);
          continue;
        }
        const SharedStep half = adamw8bit_begin(s.p, grads[i], s.q1, s.a1, s.q2, s.a2, L, c1, c2, h);
        adamw8bit_end(half, half.moments.amax1, half.moments.amax2, L, c1, c2, s.q1, s.a1, s.q2, s.a2);
      }
      return s;
    };
    cpu::use_isa(cpu::Isa::kPortable);
    const State want = run(false);
    testing::for_each_quant_isa([&](cpu::Isa) {
      EXPECT_TRUE(run(false).equal(want)) << "fused step";
      EXPECT_TRUE(run(true).equal(want)) << "the two halves";
    });
    use_device_generic_path(true);
    EXPECT_TRUE(run(false).equal(want)) << "device-generic path";
    EXPECT_TRUE(run(true).equal(want)) << "device-generic path, the two halves";
    use_device_generic_path(false);
    EXPECT_FALSE(want.q1.equal(start.q1));  // (the step did move the codes)
  }
}

TEST(Fp8States, MomentumStepEqualsOnEveryKernelSetAndTheGenericPath) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Codec c = Codec::float8_e4m3(false);
  for (const Case& k : cases()) {
    const BlockLayout L(k.shape, k.rows, k.row_len);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    const State start = fresh(L, gen);
    const at::Tensor g = at::randn({L.numel}, gen);
    for (bool nesterov : {false, true}) {
      for (float beta : {0.95f, 0.3f}) {  // both of torch.lerp's branches
        auto run = [&] {
          State s = start.clone();
          const at::Tensor u = at::empty({L.numel});
          momentum8bit_step(g, s.q1, s.a1, L, c, beta, nesterov, s.q1, s.a1, u);
          s.p = u;
          return s;
        };
        cpu::use_isa(cpu::Isa::kPortable);
        const State want = run();
        testing::for_each_quant_isa([&](cpu::Isa) { EXPECT_TRUE(run().equal(want)); });
        use_device_generic_path(true);
        EXPECT_TRUE(run().equal(want)) << "device-generic path";
        use_device_generic_path(false);
      }
    }
  }
}

TEST(Fp8States, AdamWRefusesMixedFormats) {
  const BlockLayout L(BlockShape::blocks(256), 1, 512);
  const at::Tensor p = at::zeros({512}), q = at::zeros({512}, at::kByte), a = at::zeros({2});
  EXPECT_THROW(adamw8bit_step(p, p, q, a, q.clone(), a.clone(), L, Codec::float8_e4m3(false),
                              Codec(dynamic_map(false), true), AdamWHyper{1e-3f, 0.9f, 0.99f, 1e-8f, 0, 1}),
               std::invalid_argument);
  EXPECT_THROW(state_format("float8"), std::invalid_argument);
}

}  // namespace
}  // namespace rfsdp::quant
