// The device-generic path (quant/kernels/aten/generic_ops.h: ATen operations, what a
// device without kernels runs) against the CPU kernels, through the entry points
// the optimizers call (state_ops.h), bit for bit: codes, absmax, parameters,
// dequantised values, updates, on 1-D blocks and tiles with partial edges, every
// code map the optimizers use, values that land exactly on midpoints, zero blocks.
// (Layouts whose blocks divide the region run the generic path on views, the
// others on per-element block ids: both kinds below.)
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "quant/ops.h"
#include "tests/cpp/quant_isas.h"
#include "tests/cpp/test_util.h"

namespace rfsdp::quant {
namespace {

using testing::fresh_seed;
using testing::seeded_randn;

// Runs f on the generic path, then restores the switch.
template <class F>
void on_generic_path(F&& f) {
  const bool before = device_generic_path();
  use_device_generic_path(true);
  f();
  use_device_generic_path(before);
}

struct Layout {
  int64_t rows, row_len;
  BlockShape shape;
};
const Layout kLayouts[] = {{37, 530, BlockShape::blocks(256)}, {3, 1000, BlockShape::blocks(2048)},
                           {70, 45, BlockShape::tiles(32, 32)}, {33, 97, BlockShape::tiles(32, 32)},
                           {9, 13, BlockShape::tiles(4, 5)},    {100, 1, BlockShape::blocks(7)},
                           {1, 1, BlockShape::blocks(256)},     {4, 512, BlockShape::blocks(256)},
                           {64, 96, BlockShape::tiles(32, 32)}, {8, 10, BlockShape::tiles(4, 5)},
                           {0, 7, BlockShape::blocks(256)}};  // (a rank's empty shard)

std::string name_of(const Layout& c) {
  return c.shape.str() + " over " + std::to_string(c.rows) + "x" + std::to_string(c.row_len);
}

at::Tensor random_codes(int64_t n, std::mt19937_64& rng) {
  at::Tensor q = at::empty({n}, at::kByte);
  for (int64_t e = 0; e < n; ++e) q.data_ptr<uint8_t>()[e] = static_cast<uint8_t>(rng() % 256);
  return q;
}

TEST(DeviceGeneric, QuantizeAndDequantizeEqualEveryCpuKernelBitForBit) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  struct Map {
    const char* name;
    at::Tensor code;
    bool keep_nonzero;
  };
  const Map maps[] = {{"dynamic signed", dynamic_map(true), false},
                      {"dynamic unsigned", dynamic_map(false), false},
                      {"dynamic unsigned keep_nonzero", dynamic_map(false), true},
                      {"linear signed", linear_map(true), false}};
  int k = 0;
  for (const Layout& c : kLayouts) {
    for (const Map& m : maps) {
      SCOPED_TRACE(name_of(c) + ", " + m.name);
      const Codec code(m.code, m.keep_nonzero);
      const BlockLayout L(c.shape, c.rows, c.row_len);
      const int64_t n = L.numel;
      at::Tensor x = seeded_randn({n}, seed, k++);
      if (m.code.min().item<float>() >= 0) x = x.abs();
      if (m.keep_nonzero) x.slice(0, 0, n, 3).mul_(1e-7);  // below code 1
      // Exact midpoints: with one element of 1 in the block the scale is 1, and
      // x = mid[i] is a tie (it goes to the lower code).
      const float* mid = code.lut().mid();
      for (int64_t e = 1; e < std::min<int64_t>(n, 255); e += 2) x[e] = mid[(e * 7) % 255];
      if (n > 0) x[0] = 1.0f;
      if (n > 600) x.slice(0, 300, 600).zero_();  // a zero block (1-D blocks of 256)
      at::Tensor qg = at::full({n}, 0xAB, at::kByte), ag = at::full({L.num_blocks}, -1.0f);
      at::Tensor og = at::full({n}, NAN);
      on_generic_path([&] {
        ASSERT_TRUE(quantize(x, L, code, qg, ag));
        dequantize(qg, ag, L, code, og);
      });
      // The codes are the nearest by the midpoints, ties to the lower (the reference search).
      const float* xv = x.data_ptr<float>();
      for (int64_t b = 0; b < L.num_blocks; ++b) {
        const auto blk = L.block(b);
        const float a = ag.data_ptr<float>()[b];
        for (int64_t s = 0; s < blk.segments; ++s) {
          for (int64_t i = 0; i < blk.seg_len; ++i) {
            const int64_t e = blk.start + s * c.row_len + i;
            ASSERT_EQ(qg.data_ptr<uint8_t>()[e],
                      code.lut().nearest_by_search(xv[e] * (a > 0 ? 1.0f / a : 0.0f)))
                << "element " << e;
          }
        }
      }
      testing::for_each_quant_isa([&](cpu::Isa) {
        at::Tensor q = at::full({n}, 0xCD, at::kByte), a = at::full({L.num_blocks}, -2.0f);
        at::Tensor o = at::full({n}, NAN);
        ASSERT_TRUE(quantize(x, L, code, q, a));
        dequantize(q, a, L, code, o);
        ASSERT_TRUE(at::equal(q, qg)) << "codes differ";
        ASSERT_TRUE(at::equal(a, ag)) << "absmax differs";
        ASSERT_TRUE(at::equal(o, og)) << "dequantised values differ";
      });
      for (float bad : {NAN, INFINITY}) {
        if (n == 0) break;
        at::Tensor y = x.clone();
        y[n / 2] = bad;
        on_generic_path([&] { EXPECT_FALSE(quantize(y, L, code, qg, ag)) << "missed " << bad; });
      }
    }
  }
}

TEST(DeviceGeneric, AdamW8bitStepAndItsHalvesEqualEveryCpuKernelBitForBit) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const Codec code1(dynamic_map(true)), code2(dynamic_map(false), /*keep_nonzero=*/true);
  int k = 0;
  for (const Layout& c : kLayouts) {
    SCOPED_TRACE(name_of(c));
    const BlockLayout L(c.shape, c.rows, c.row_len);
    const int64_t n = L.numel, nb = L.num_blocks;
    const at::Tensor p0 = seeded_randn({n}, seed, 100 + k);
    at::Tensor g = seeded_randn({n}, seed, 200 + k) * 1e-2;
    if (n > 600) g.slice(0, 256, 512).zero_();
    const at::Tensor q10 = random_codes(n, rng), q20 = random_codes(n, rng);
    at::Tensor a10 = seeded_randn({nb}, seed, 300 + k).abs() * 0.01;
    const at::Tensor a20 = seeded_randn({nb}, seed, 400 + k).abs() * 1e-4;
    if (nb > 2) a10[1] = 0.0f;  // a block whose moment decodes to zero
    // The agreed absmax of shared blocks: at least this rank's (the max over ranks).
    const at::Tensor grow = 1 + seeded_randn({nb}, seed, 500 + k).abs();
    ++k;
    for (const AdamWHyper& h : {AdamWHyper{1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, 3},
                                AdamWHyper{3e-2f, 0.5f, 0.95f, 1e-6f, 0.0f, 1}}) {
      struct Out {
        at::Tensor p, q1, a1, q2, a2;  // one whole step
        at::Tensor hp, hq1, ha1, hq2, ha2, amax1, amax2;  // the two halves
      };
      auto run = [&] {
        Out o{p0.clone(), q10.clone(), a10.clone(), q20.clone(), a20.clone(),
              p0.clone(), q10.clone(), a10.clone(), q20.clone(), a20.clone(), {}, {}};
        adamw8bit_step(o.p, g, o.q1, o.a1, o.q2, o.a2, L, code1, code2, h);
        const SharedStep s = adamw8bit_begin(o.hp, g, o.hq1, o.ha1, o.hq2, o.ha2, L, code1, code2, h);
        o.amax1 = s.moments.amax1.clone();
        o.amax2 = s.moments.amax2.clone();
        adamw8bit_end(s, (o.amax1 * grow).contiguous(), (o.amax2 * grow).contiguous(), L, code1,
                      code2, o.hq1, o.ha1, o.hq2, o.ha2);
        return o;
      };
      Out want;
      on_generic_path([&] { want = run(); });
      ASSERT_TRUE(n == 0 || !at::equal(want.p, p0)) << "the step changed nothing";
      ASSERT_TRUE(at::equal(want.hp, want.p)) << "the halves' parameter is not the step's";
      ASSERT_TRUE(at::equal(want.amax1, want.a1)) << "the halves' amax is not the step's absmax";
      testing::for_each_quant_isa([&](cpu::Isa) {
        const Out got = run();
        ASSERT_TRUE(at::equal(got.p, want.p)) << "parameters differ";
        ASSERT_TRUE(at::equal(got.q1, want.q1)) << "m codes differ";
        ASSERT_TRUE(at::equal(got.q2, want.q2)) << "v codes differ";
        ASSERT_TRUE(at::equal(got.a1, want.a1)) << "m absmax differs";
        ASSERT_TRUE(at::equal(got.a2, want.a2)) << "v absmax differs";
        ASSERT_TRUE(at::equal(got.hp, want.hp)) << "halves: parameters differ";
        ASSERT_TRUE(at::equal(got.amax1, want.amax1) && at::equal(got.amax2, want.amax2))
            << "halves: this rank's amax differs";
        ASSERT_TRUE(at::equal(got.hq1, want.hq1) && at::equal(got.hq2, want.hq2))
            << "halves: codes under the agreed absmax differ";
        ASSERT_TRUE(at::equal(got.ha1, want.ha1) && at::equal(got.ha2, want.ha2))
            << "halves: stored absmax differs";
      });
    }
  }
}

TEST(DeviceGeneric, Momentum8bitStepEqualsEveryCpuKernelBitForBit) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  int k = 0;
  for (const char* map : {"dynamic", "linear"}) {
    const Codec code(code_map(map, true));
    for (int64_t block : {256, 7, 2048}) {
      for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{5000}}) {
        const BlockLayout L(BlockShape::blocks(block), 1, n);
        const at::Tensor g = seeded_randn({n}, seed, k);
        const at::Tensor q = random_codes(n, rng);
        at::Tensor a = seeded_randn({L.num_blocks}, seed, 1000 + k++).abs();
        if (L.num_blocks > 1) a[0] = 0.0f;
        for (float beta : {0.95f, 0.3f}) {  // torch.lerp's two branches
          for (bool nesterov : {true, false}) {
            SCOPED_TRACE(std::string(map) + ", block " + std::to_string(block) + ", n " +
                         std::to_string(n) + ", beta " + std::to_string(beta) +
                         (nesterov ? ", nesterov" : ""));
            auto run = [&](at::Tensor* qo, at::Tensor* ao, at::Tensor* u) {
              *qo = at::full({n}, 0xAB, at::kByte);
              *ao = at::full({L.num_blocks}, -1.0f);
              *u = at::full({n}, NAN);
              momentum8bit_step(g, q, a, L, code, beta, nesterov, *qo, *ao, *u);
            };
            at::Tensor wq, wa, wu;
            on_generic_path([&] { run(&wq, &wa, &wu); });
            testing::for_each_quant_isa([&](cpu::Isa) {
              at::Tensor gq, ga, gu;
              run(&gq, &ga, &gu);
              ASSERT_TRUE(at::equal(gu, wu)) << "updates differ";
              ASSERT_TRUE(at::equal(gq, wq)) << "codes differ";
              ASSERT_TRUE(at::equal(ga, wa)) << "absmax differs";
            });
            // In place (q_out = q), as the optimizer may call it.
            at::Tensor qi = q.clone(), ai = a.clone(), ui = at::empty({n});
            on_generic_path([&] { momentum8bit_step(g, qi, ai, L, code, beta, nesterov, qi, ai, ui); });
            ASSERT_TRUE(at::equal(qi, wq) && at::equal(ai, wa) && at::equal(ui, wu)) << "in place";
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace rfsdp::quant
