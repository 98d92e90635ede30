// The arithmetic nearest-code index and the kernel sets: the index against the
// binary search on a fresh sample of all floats in (-2, 2) and around every
// midpoint; codes it must refuse; and the AVX-512 kernels against the portable
// ones (codes, absmax, dequantised values bit for bit; the fused AdamW8bit step
// to float rounding) on shapes that exercise every chunk kind.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "quant/formats/code_index.h"
#include "quant/formats/code_maps.h"
#include "quant/kernels/cpu/avx2.h"
#include "quant/kernels/cpu/avx512.h"
#include "quant/kernels/cpu/gathers.h"
#include "quant/kernels/cpu/kernels.h"
#include "tests/cpp/quant_isas.h"
#include "tests/cpp/test_util.h"

namespace rfsdp::quant {
namespace {

using testing::float_of;
using testing::fresh_seed;

std::vector<at::Tensor> shipped_maps() {
  return {dynamic_map(true), dynamic_map(false), linear_map(true), linear_map(false)};
}

// Every (code, rounding) the library quantises with: the shipped maps, and the
// unsigned ones with keep_nonzero (the second moments').
struct Rounding {
  at::Tensor code;
  bool keep_nonzero;
};
std::vector<Rounding> shipped_roundings() {
  std::vector<Rounding> out;
  for (const at::Tensor& code : shipped_maps()) out.push_back({code, false});
  out.push_back({dynamic_map(false), true});
  out.push_back({linear_map(false), true});
  return out;
}

TEST(CodeIndex, EqualsTheBinarySearchOnASampleOfEveryFloat) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // RFSDP_EXHAUSTIVE=1: every float in (-2, 2) (minutes), else a fresh 1/211 of them.
  const bool all = std::getenv("RFSDP_EXHAUSTIVE") != nullptr;
  const uint32_t stride = all ? 1 : 211;
  for (const auto& [code, keep_nonzero] : shipped_roundings()) {
    SCOPED_TRACE(keep_nonzero ? "keep_nonzero" : "nearest");
    const cpu::CodeLut lut(code.data_ptr<float>(), keep_nonzero);
    ASSERT_NE(lut.index(), nullptr) << "the shipped maps all have an arithmetic index";
    const CodeIndex& ix = *lut.index();
    const uint32_t offset = static_cast<uint32_t>(rng() % stride);
    for (uint32_t sign : {0u, 0x80000000u}) {
      for (uint32_t b = offset; b < 0x40000000u; b += stride) {  // |v| < 2
        const float v = float_of(sign | b);
        ASSERT_EQ(ix.nearest(v, lut.mid()), lut.nearest_by_search(v)) << "v = " << v;
      }
    }
    // Every midpoint, its neighbours, every code and its neighbours.
    for (int i = 0; i < 255; ++i) {
      for (float c : {lut.mid()[i], lut.code()[i]}) {
        for (float v : {c, std::nextafter(c, 3.0f), std::nextafter(c, -3.0f)}) {
          ASSERT_EQ(ix.nearest(v, lut.mid()), lut.nearest_by_search(v)) << "v = " << v;
        }
      }
    }
  }
}

// keep_nonzero: the search itself, against its definition on the values that
// matter (the smallest positive floats, up to the first code's neighbourhood):
// 0 takes code 0, anything above 0 code 1 at least, and from code 1 on the
// nearest code as before. Signed codes refuse the rule.
TEST(CodeLut, KeepNonzeroNeverRoundsAPositiveValueToZero) {
  for (const at::Tensor& code : {dynamic_map(false), linear_map(false)}) {
    const cpu::CodeLut nearest(code.data_ptr<float>()), kept(code.data_ptr<float>(), true);
    const float c1 = kept.code()[1];
    EXPECT_EQ(kept.nearest(0.0f), 0);
    EXPECT_EQ(kept.nearest_by_search(0.0f), 0);
    for (float v = std::numeric_limits<float>::denorm_min(); v < 4 * c1; v = v < 1e-30f ? v * 2 : v * 1.01f) {
      const int want = nearest.nearest_by_search(v) == 0 ? 1 : nearest.nearest_by_search(v);
      ASSERT_EQ(kept.nearest_by_search(v), want) << "v = " << v;
      ASSERT_EQ(kept.nearest(v), want) << "v = " << v;
    }
    for (int i = 1; i < 256; ++i) EXPECT_EQ(kept.mid()[i], nearest.mid()[i]) << "midpoint " << i;
  }
  EXPECT_THROW(cpu::CodeLut(dynamic_map(true).data_ptr<float>(), true), std::invalid_argument);
  EXPECT_NE(code_lut(dynamic_map(false), true), code_lut(dynamic_map(false), false));
}

TEST(CodeIndex, RefusedWhereTheStructureDoesNotFit) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // One code of the dynamic map moved a third of the way to its neighbour: the
  // decade formula no longer finds it, and the index must say so.
  at::Tensor moved = dynamic_map(true).clone();
  const int i = 140 + static_cast<int>(rng() % 100);
  float* c = moved.data_ptr<float>();
  c[i] = c[i] + (c[i + 1] - c[i]) / 3;
  EXPECT_EQ(cpu::CodeLut(c).index(), nullptr) << "code " << i << " moved";
  // A sorted random code.
  at::Tensor random = std::get<0>(at::rand({256}).mul(2).sub(1).sort());
  EXPECT_EQ(cpu::CodeLut(random.data_ptr<float>()).index(), nullptr);
  // Such codes still quantise (the portable kernels, whatever the ISA) to their nearest code.
  testing::for_each_quant_isa([&](cpu::Isa) {
    for (const at::Tensor& code : {moved, random}) {
      const auto lut = code_lut(code);
      const at::Tensor x = testing::seeded_randn({5, 300}, seed, 1);
      const BlockLayout L(BlockShape::blocks(256), 5, 300);
      at::Tensor q = at::empty({1500}, at::kByte), a = at::empty({L.num_blocks});
      ASSERT_TRUE(cpu::quantize(x.data_ptr<float>(), L, *lut, q.data_ptr<uint8_t>(),
                                a.data_ptr<float>()));
      for (int64_t e = 0; e < 1500; ++e) {
        const float v = x.data_ptr<float>()[e] * (1.0f / a.data_ptr<float>()[e / 256]);
        ASSERT_EQ(q.data_ptr<uint8_t>()[e], lut->nearest_by_search(v)) << "element " << e;
      }
    }
  });
}

// Quantised by every kernel set, each block holding a +-1 so its scale is exactly
// 1: the codes must be the binary search's for the very values given.
// RFSDP_QUANT_GATHERS (cpu/gathers.h): 1 and 0 set the AVX-512 encode path, unset
// leaves the CPU's default, and any other value is an error that names it.
TEST(Kernels, GathersSettingReadsOneOrZeroAndRefusesOtherValues) {
  const char* before = std::getenv("RFSDP_QUANT_GATHERS");
  const std::string saved = before ? before : "";
  setenv("RFSDP_QUANT_GATHERS", "1", 1);
  EXPECT_TRUE(cpu::gathers_by_default());
  setenv("RFSDP_QUANT_GATHERS", "0", 1);
  EXPECT_FALSE(cpu::gathers_by_default());
  for (const char* bad : {"yes", "", "true", "2"}) {
    setenv("RFSDP_QUANT_GATHERS", bad, 1);
    try {
      cpu::gathers_by_default();
      ADD_FAILURE() << "'" << bad << "' accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("RFSDP_QUANT_GATHERS is '" + std::string(bad) + "'"),
                std::string::npos) << e.what();
    }
  }
  unsetenv("RFSDP_QUANT_GATHERS");
  EXPECT_NO_THROW(cpu::gathers_by_default());
  if (before) setenv("RFSDP_QUANT_GATHERS", saved.c_str(), 1);
}

TEST(Kernels, QuantiseGivesTheSearchsCodeForEveryValue) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t n = int64_t{1} << 20;
  for (const auto& [code, keep_nonzero] : shipped_roundings()) {
    SCOPED_TRACE(keep_nonzero ? "keep_nonzero" : "nearest");
    const auto lut = code_lut(code, keep_nonzero);
    at::Tensor x = at::empty({n});
    float* xv = x.data_ptr<float>();
    for (int64_t e = 0; e < n; ++e) {
      // random bit patterns in (-1, 1), a quarter of them in the decades down to 1e-7
      const uint32_t mag = rng() % 4 ? static_cast<uint32_t>(rng() % 0x3F800000u)
                                     : 0x33800000u + static_cast<uint32_t>(rng() % 0x0C000000u);
      xv[e] = float_of(mag | ((rng() & 1) ? 0x80000000u : 0u));
    }
    // a +-1 in every block and tile row, so every scale is exactly 1
    for (int64_t e = 0; e < n; e += 32) xv[e] = (e / 32) % 2 ? 1.0f : -1.0f;
    for (BlockShape shape : {BlockShape::blocks(256), BlockShape::blocks(2048), BlockShape::tiles(32, 32)}) {
      SCOPED_TRACE(shape.str());
      const BlockLayout L(shape, n / 1024, 1024);
      auto block_of = [&](int64_t e) {
        return shape.is_tile() ? (e / 1024 / 32) * L.tiles_per_row + (e % 1024) / 32 : e / shape.block;
      };
      testing::for_each_quant_isa([&](cpu::Isa) {
        at::Tensor q = at::full({n}, 0xAB, at::kByte), a = at::empty({L.num_blocks});
        ASSERT_TRUE(cpu::quantize(xv, L, *lut, q.data_ptr<uint8_t>(), a.data_ptr<float>()));
        for (int64_t e = 0; e < n; ++e) {
          ASSERT_EQ(q.data_ptr<uint8_t>()[e], lut->nearest_by_search(xv[e])) << "x = " << xv[e];
        }
        // Dequantised past 4 MiB (streaming stores where aligned: runs of 64, a
        // tile's rows in pairs), at an aligned output and one float off: code
        // times absmax, every element.
        at::Tensor out = at::full({n + 1}, NAN);
        for (int shift : {0, 1}) {
          float* o = out.data_ptr<float>() + shift;
          cpu::dequantize(q.data_ptr<uint8_t>(), a.data_ptr<float>(), L, *lut, o);
          for (int64_t e = 0; e < n; ++e) {
            ASSERT_EQ(o[e], lut->code()[q.data_ptr<uint8_t>()[e]] * a.data_ptr<float>()[block_of(e)])
                << "element " << e;
          }
        }
      });
    }
  }
}

// Values within a few hundred ulps of every midpoint, where AVX2's truncated
// midpoint cannot decide and the exact one must: every kernel set gives the
// search's code (each block holds a +-1, so its scale is exactly 1).
TEST(Kernels, QuantiseDecidesExactlyNextToEveryMidpoint) {
  for (const auto& [code, keep_nonzero] : shipped_roundings()) {
    SCOPED_TRACE(keep_nonzero ? "keep_nonzero" : "nearest");
    const auto lut = code_lut(code, keep_nonzero);
    std::vector<float> xs;
    for (int i = 0; i < 255; ++i) {
      const float m = lut->mid()[i];
      uint32_t bits;
      std::memcpy(&bits, &m, 4);
      for (int d = -300; d <= 300; d += 3) {
        const float v = float_of(bits + static_cast<uint32_t>(d));
        if (std::fabs(v) < 1.0f && std::isfinite(v)) xs.push_back(v);
      }
    }
    const int64_t n = (static_cast<int64_t>(xs.size()) + 255) / 256 * 256;
    xs.resize(n, 0.0f);
    for (int64_t e = 0; e < n; e += 256) xs[e] = (e / 256) % 2 ? 1.0f : -1.0f;
    const BlockLayout L(BlockShape::blocks(256), 1, n);
    testing::for_each_quant_isa([&](cpu::Isa) {
      at::Tensor q = at::full({n}, 0xAB, at::kByte), a = at::empty({L.num_blocks});
      ASSERT_TRUE(cpu::quantize(xs.data(), L, *lut, q.data_ptr<uint8_t>(), a.data_ptr<float>()));
      for (int64_t e = 0; e < n; ++e) {
        ASSERT_EQ(q.data_ptr<uint8_t>()[e], lut->nearest_by_search(xs[e])) << "x = " << xs[e];
      }
    });
  }
}

// AVX-512 against portable: the same codes, absmax and dequantised values on
// shapes with long rows and tails, tiles with partial edges, an odd number of
// tile rows (a chunk half empty), rows shorter than a chunk, zero blocks, NaN.
TEST(Kernels, Avx512EqualsPortableBitForBit) {
  if (!cpu::isa_supported(cpu::Isa::kAvx512)) GTEST_SKIP() << "this CPU has no AVX-512 VBMI";
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  struct Case {
    int64_t rows, row_len;
    BlockShape shape;
  };
  const Case cases[] = {{37, 530, BlockShape::blocks(256)}, {3, 1000, BlockShape::blocks(2048)},
                        {70, 45, BlockShape::tiles(32, 32)}, {33, 97, BlockShape::tiles(32, 32)},
                        {9, 13, BlockShape::tiles(4, 5)},    {5, 200, BlockShape::tiles(3, 64)},
                        {100, 1, BlockShape::blocks(7)},     {2, 64, BlockShape::tiles(2, 64)}};
  const cpu::Isa before = cpu::active_isa();
  int k = 0;
  for (const Case& c : cases) {
    for (int variant = 0; variant < 3; ++variant) {  // signed, unsigned, unsigned keep_nonzero
      const bool is_signed = variant == 0, keep_nonzero = variant == 2;
      SCOPED_TRACE(c.shape.str() + " over " + std::to_string(c.rows) + "x" +
                   std::to_string(c.row_len) + (is_signed ? " signed" : " unsigned") +
                   (keep_nonzero ? " keep_nonzero" : ""));
      const at::Tensor code = dynamic_map(is_signed);
      const auto lut = code_lut(code, keep_nonzero);
      at::Tensor x = testing::seeded_randn({c.rows, c.row_len}, seed, k++);
      if (!is_signed) x = x.abs();
      if (keep_nonzero) x.view(-1).slice(0, 0, x.numel(), 3).mul_(1e-7);  // values below code 1
      x.view(-1).slice(0, 0, std::min<int64_t>(40, x.numel())).zero_();  // zero blocks
      const BlockLayout L(c.shape, c.rows, c.row_len);
      const int64_t n = c.rows * c.row_len;
      at::Tensor q[2], a[2], out[2];
      for (int i = 0; i < 2; ++i) {
        cpu::use_isa(i ? cpu::Isa::kAvx512 : cpu::Isa::kPortable);
        q[i] = at::full({n}, 0xAB, at::kByte);
        a[i] = at::full({L.num_blocks}, -1.0f);
        out[i] = at::full({n}, NAN);
        ASSERT_TRUE(cpu::quantize(x.data_ptr<float>(), L, *lut, q[i].data_ptr<uint8_t>(),
                                  a[i].data_ptr<float>()));
        cpu::dequantize(q[i].data_ptr<uint8_t>(), a[i].data_ptr<float>(), L, *lut,
                        out[i].data_ptr<float>());
      }
      cpu::use_isa(before);
      ASSERT_TRUE(at::equal(q[0], q[1])) << "codes differ";
      ASSERT_TRUE(at::equal(a[0], a[1])) << "absmax differs";
      ASSERT_TRUE(at::equal(out[0], out[1])) << "dequantised values differ";
      // NaN and Inf are reported by both.
      for (float bad : {NAN, INFINITY}) {
        at::Tensor y = x.clone();
        y.view(-1)[n / 2] = bad;
        for (cpu::Isa isa : testing::quant_isas()) {
          cpu::use_isa(isa);
          EXPECT_FALSE(cpu::quantize(y.data_ptr<float>(), L, *lut, q[0].data_ptr<uint8_t>(),
                                     a[0].data_ptr<float>()))
              << cpu::isa_name(isa) << " missed " << bad;
        }
        cpu::use_isa(before);
      }
    }
  }
}

// The fused AdamW8bit step and its two halves: AVX-512 against portable, one
// step from a random state, bit for bit (parameters, codes, absmax): both run
// adamw_update's IEEE operations in order, without FMA.
TEST(Kernels, Avx512AdamW8bitStepEqualsPortableBitForBit) {
  if (!cpu::isa_supported(cpu::Isa::kAvx512)) GTEST_SKIP() << "this CPU has no AVX-512 VBMI";
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const auto lut1 = code_lut(dynamic_map(true)), lut2 = code_lut(dynamic_map(false), true);
  const cpu::Isa before = cpu::active_isa();
  int k = 0;
  for (BlockShape shape : {BlockShape::blocks(256), BlockShape::tiles(32, 32), BlockShape::blocks(100)}) {
    SCOPED_TRACE(shape.str());
    const int64_t rows = 67, row_len = 131, n = rows * row_len;
    const BlockLayout L(shape, rows, row_len);
    const at::Tensor p0 = testing::seeded_randn({n}, seed, 100 + k);
    const at::Tensor g = testing::seeded_randn({n}, seed, 200 + k) * 1e-2;
    at::Tensor q10 = at::empty({n}, at::kByte), q20 = at::empty({n}, at::kByte);
    for (int64_t e = 0; e < n; ++e) {
      q10.data_ptr<uint8_t>()[e] = static_cast<uint8_t>(rng() % 256);
      q20.data_ptr<uint8_t>()[e] = static_cast<uint8_t>(rng() % 256);
    }
    const at::Tensor a10 = testing::seeded_randn({L.num_blocks}, seed, 300 + k).abs() * 0.01;
    const at::Tensor a20 = testing::seeded_randn({L.num_blocks}, seed, 400 + k).abs() * 1e-4;
    ++k;
    at::Tensor p[2], q1[2], q2[2], a1[2], a2[2];
    for (int i = 0; i < 2; ++i) {
      p[i] = p0.clone(), q1[i] = q10.clone(), q2[i] = q20.clone();
      a1[i] = a10.clone(), a2[i] = a20.clone();
      cpu::use_isa(i ? cpu::Isa::kAvx512 : cpu::Isa::kPortable);
      cpu::adamw8bit_step(p[i].data_ptr<float>(), g.data_ptr<float>(), q1[i].data_ptr<uint8_t>(),
                          a1[i].data_ptr<float>(), q2[i].data_ptr<uint8_t>(),
                          a2[i].data_ptr<float>(), L, *lut1, *lut2,
                          {1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, 3});
    }
    cpu::use_isa(before);
    ASSERT_TRUE(at::equal(p[0], p[1])) << "parameters differ";
    ASSERT_TRUE(at::equal(q1[0], q1[1])) << "m codes differ";
    ASSERT_TRUE(at::equal(q2[0], q2[1])) << "v codes differ";
    ASSERT_TRUE(at::equal(a1[0], a1[1])) << "m absmax differs";
    ASSERT_TRUE(at::equal(a2[0], a2[1])) << "v absmax differs";
    ASSERT_FALSE(at::equal(p[0], p0)) << "the step changed nothing";
  }
}

// The 8-bit momentum step reports a NaN or an Inf the new momentum holds
// (from the gradient, or from a scale that overflows), on every kernel set,
// wherever in a block (first lane, middle, a partial last block) and of either sign.
TEST(Kernels, MomentumStepReportsNanAndInfOnEveryKernelSet) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const at::Tensor code = dynamic_map(true);
  const cpu::CodeLut lut(code.data_ptr<float>());
  const int64_t n = 1000;
  const BlockLayout L(BlockShape::blocks(256), 1, n);
  const at::Tensor q = at::randint(0, 256, {n}, at::kByte);
  const at::Tensor a = testing::seeded_randn({L.num_blocks}, seed, 1).abs();
  const cpu::Isa before = cpu::active_isa();
  for (cpu::Isa isa : testing::quant_isas()) {
    cpu::use_isa(isa);
    at::Tensor qo = at::empty({n}, at::kByte), ao = at::empty({L.num_blocks}), u = at::empty({n});
    at::Tensor g = testing::seeded_randn({n}, seed, 2);
    EXPECT_TRUE(cpu::momentum8bit_step(g.data_ptr<float>(), q.data_ptr<uint8_t>(),
                                       a.data_ptr<float>(), L, lut, 0.9f, true,
                                       qo.data_ptr<uint8_t>(), ao.data_ptr<float>(),
                                       u.data_ptr<float>()))
        << cpu::isa_name(isa) << ": a finite step reported";
    for (float bad : {NAN, -NAN, INFINITY, -INFINITY}) {
      for (int64_t at : {int64_t{0}, int64_t{300}, n - 1}) {
        at::Tensor gb = g.clone();
        gb[at] = bad;
        EXPECT_FALSE(cpu::momentum8bit_step(gb.data_ptr<float>(), q.data_ptr<uint8_t>(),
                                            a.data_ptr<float>(), L, lut, 0.9f, true,
                                            qo.data_ptr<uint8_t>(), ao.data_ptr<float>(),
                                            u.data_ptr<float>()))
            << cpu::isa_name(isa) << " missed " << bad << " at " << at;
      }
    }
  }
  cpu::use_isa(before);
}

// The SIMD kernels carry state from block to block (an absmax taken a block
// ahead, AVX-512's pipelined AdamW8bit step, its two scratch slots), so a range
// [b0, b1) that starts or ends anywhere must give the bits the whole range gives:
// the kernel sets called directly on random splits (the dispatcher's thread
// tasks), on 1-D blocks with a partial last one and 32x32 tiles with partial
// edges, against one call over every block.
TEST(Kernels, AnySplitIntoBlockRangesGivesTheWholeRangesBits) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const auto lut1 = code_lut(dynamic_map(true)), lut2 = code_lut(dynamic_map(false), true);
  const AdamWCoeffs coeffs = adamw_coeffs({1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, 3});
  struct Case {
    int64_t rows, row_len;
    BlockShape shape;
  };
  const Case cases[] = {{37, 530, BlockShape::blocks(256)}, {5, 1000, BlockShape::blocks(2048)},
                        {70, 131, BlockShape::tiles(32, 32)}, {96, 96, BlockShape::tiles(32, 32)}};
  std::vector<cpu::Isa> isas;
  for (cpu::Isa isa : {cpu::Isa::kAvx2, cpu::Isa::kAvx512}) {
    if (cpu::isa_supported(isa)) isas.push_back(isa);
  }
  if (isas.empty()) GTEST_SKIP() << "this CPU has neither AVX2 nor AVX-512 VBMI";
  int k = 0;
  for (const Case& c : cases) {
    const BlockLayout L(c.shape, c.rows, c.row_len);
    const int64_t n = c.rows * c.row_len, nb = L.num_blocks, w = L.max_block_elems();
    const at::Tensor x = testing::seeded_randn({n}, seed, k++);
    const at::Tensor g = testing::seeded_randn({n}, seed, k++) * 1e-2;
    const at::Tensor p0 = testing::seeded_randn({n}, seed, k++);
    at::Tensor q10 = at::empty({n}, at::kByte), q20 = at::empty({n}, at::kByte);
    for (int64_t e = 0; e < n; ++e) {
      q10.data_ptr<uint8_t>()[e] = static_cast<uint8_t>(rng() % 256);
      q20.data_ptr<uint8_t>()[e] = static_cast<uint8_t>(rng() % 256);
    }
    const at::Tensor a10 = testing::seeded_randn({nb}, seed, k++).abs() * 0.01;
    const at::Tensor a20 = testing::seeded_randn({nb}, seed, k++).abs() * 1e-4;
    for (cpu::Isa isa : isas) {
      SCOPED_TRACE(std::string(cpu::isa_name(isa)) + ", " + c.shape.str() + " over " +
                   std::to_string(c.rows) + "x" + std::to_string(c.row_len));
      const bool wide = isa == cpu::Isa::kAvx512;
      // every kernel of this set over [b0, b1), in place on the tensors given
      auto run = [&](int64_t b0, int64_t b1, at::Tensor* out) {
        bool bad = false;
        std::vector<float> buf(4 * w);
        float* f = out[0].data_ptr<float>();  // quantise's absmax
        uint8_t* q = out[1].data_ptr<uint8_t>();
        float *p = out[2].data_ptr<float>(), *a1 = out[5].data_ptr<float>(), *a2 = out[6].data_ptr<float>();
        uint8_t *q1 = out[3].data_ptr<uint8_t>(), *q2 = out[4].data_ptr<uint8_t>();
        uint8_t* qm = out[7].data_ptr<uint8_t>();
        float *am = out[8].data_ptr<float>(), *u = out[9].data_ptr<float>();
        if (wide) {
          cpu::avx512::quantize_blocks(x.data_ptr<float>(), L, *lut1, q, f, b0, b1, &bad);
          cpu::avx512::adamw8bit_blocks(p, g.data_ptr<float>(), q1, a1, q2, a2, L, *lut1, *lut2,
                                        coeffs, b0, b1, buf.data());
          cpu::avx512::momentum8bit_blocks(g.data_ptr<float>(), q10.data_ptr<uint8_t>(),
                                           a10.data_ptr<float>(), L, *lut1, 0.95f, true, qm, am, u,
                                           b0, b1, buf.data(), &bad);
        } else {
          cpu::avx2::quantize_blocks(x.data_ptr<float>(), L, *lut1, q, f, b0, b1, &bad);
          cpu::avx2::adamw8bit_blocks(p, g.data_ptr<float>(), q1, a1, q2, a2, L, *lut1, *lut2,
                                      coeffs, b0, b1, buf.data(), buf.data() + w);
          cpu::avx2::momentum8bit_blocks(g.data_ptr<float>(), q10.data_ptr<uint8_t>(),
                                         a10.data_ptr<float>(), L, *lut1, 0.95f, true, qm, am, u, b0,
                                         b1, buf.data(), &bad);
        }
        EXPECT_FALSE(bad);
      };
      auto fresh = [&] {
        return std::vector<at::Tensor>{at::full({nb}, -1.0f), at::full({n}, 0xAB, at::kByte),
                                       p0.clone(), q10.clone(), q20.clone(), a10.clone(),
                                       a20.clone(), at::full({n}, 0xCD, at::kByte),
                                       at::full({nb}, -1.0f), at::full({n}, NAN)};
      };
      std::vector<at::Tensor> whole = fresh();
      run(0, nb, whole.data());
      ASSERT_FALSE(at::equal(whole[2], p0)) << "the step changed nothing";
      for (int trial = 0; trial < 4; ++trial) {
        std::vector<int64_t> cuts = {0, nb};
        for (int i = 0; i < 3; ++i) cuts.push_back(static_cast<int64_t>(rng() % (nb + 1)));
        if (trial == 0) cuts.push_back(1), cuts.push_back(nb - 1);  // single-block ends
        std::sort(cuts.begin(), cuts.end());
        std::vector<at::Tensor> split = fresh();
        std::string where;
        for (size_t i = 0; i + 1 < cuts.size(); ++i) {
          run(cuts[i], cuts[i + 1], split.data());  // empty ranges too
          where += std::to_string(cuts[i]) + " ";
        }
        SCOPED_TRACE("cuts " + where + "of " + std::to_string(nb) + " blocks");
        const char* names[] = {"quantise absmax", "quantise codes", "parameters", "m codes",
                               "v codes", "m absmax", "v absmax", "momentum codes",
                               "momentum absmax", "momentum update"};
        for (int t = 0; t < 10; ++t) EXPECT_TRUE(at::equal(whole[t], split[t])) << names[t] << " differ";
      }
    }
  }
}

}  // namespace
}  // namespace rfsdp::quant
