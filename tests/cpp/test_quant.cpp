// Block-wise 8-bit quantisation: the maps against a transcription of their
// definition, the lookup table against a binary search, quantise/dequantise
// against straightforward per-block code (every element checked, outputs
// poisoned first).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "quant/formats/code_maps.h"
#include "quant/kernels/cpu/kernels.h"
#include "quant/ops/blockwise.h"
#include "tests/cpp/quant_isas.h"
#include "tests/cpp/test_util.h"

namespace rfsdp::quant {
namespace {

using testing::fresh_seed;

// bitsandbytes' create_dynamic_map(signed, 7, 8), line by line with the same
// float32 tensor operations: levels of linspace(0.1, 1, k) midpoints scaled by
// 10^(i-6), mirrored when signed, then 0 and 1, sorted.
at::Tensor dynamic_map_definition(bool is_signed) {
  std::vector<float> data;
  const int non_sign_bits = 7, max_exponent_bits = 7;
  for (int i = 0; i < max_exponent_bits; ++i) {
    const int64_t fraction_items = is_signed ? (1 << (i + non_sign_bits - max_exponent_bits)) + 1
                                             : (1 << (i + non_sign_bits - max_exponent_bits + 1)) + 1;
    at::Tensor boundaries = at::linspace(0.1, 1, fraction_items);
    at::Tensor means = (boundaries.slice(0, 0, -1) + boundaries.slice(0, 1)) / 2.0;
    at::Tensor scaled = means * std::pow(10.0, -(max_exponent_bits - 1) + i);
    for (int64_t j = 0; j < scaled.numel(); ++j) data.push_back(scaled[j].item<float>());
    if (is_signed) {
      at::Tensor neg = -scaled;
      for (int64_t j = 0; j < neg.numel(); ++j) data.push_back(neg[j].item<float>());
    }
  }
  data.push_back(0);
  data.push_back(1.0);
  EXPECT_EQ(data.size(), 256u);
  std::sort(data.begin(), data.end());
  return at::tensor(data);
}

TEST(CodeMaps, DynamicMapsEqualTheDefinitionValueByValue) {
  for (bool s : {true, false}) {
    const at::Tensor got = dynamic_map(s), want = dynamic_map_definition(s);
    ASSERT_EQ(got.numel(), 256);
    for (int i = 0; i < 256; ++i) {
      ASSERT_EQ(got[i].item<float>(), want[i].item<float>()) << "signed " << s << " value " << i;
    }
    EXPECT_EQ(got.max().item<float>(), 1.0f);
    EXPECT_TRUE((got.slice(0, 1) >= got.slice(0, 0, -1)).all().item<bool>());
  }
  EXPECT_NEAR(dynamic_map(true).min().item<float>(), -0.99296875f, 1e-7);
  EXPECT_EQ(dynamic_map(false).min().item<float>(), 0.0f);
}

TEST(CodeMaps, LinearMap) {
  EXPECT_TRUE(at::equal(linear_map(true), at::linspace(-1.0, 1.0, 256)));
  EXPECT_TRUE(at::equal(linear_map(false), at::linspace(0.0, 1.0, 256)));
  EXPECT_THROW(code_map("cubic", true), std::invalid_argument);
}

TEST(CodeLut, TableAgreesWithBinarySearchEverywhere) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const at::Tensor& code : {dynamic_map(true), dynamic_map(false), linear_map(true),
                                 linear_map(false)}) {
    const cpu::CodeLut lut(code.data_ptr<float>());
    ASSERT_TRUE(lut.table_exact());
    // Random values, all codes, all midpoints and their float neighbours.
    std::vector<float> probe;
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (int i = 0; i < 200000; ++i) probe.push_back(u(rng));
    for (int i = 0; i < 20000; ++i) probe.push_back(u(rng) * std::pow(10.0f, -float(i % 12)));
    for (int i = 0; i < 256; ++i) {
      const float c = code[i].item<float>();
      probe.push_back(c);
      if (i < 255) {
        const float m = (c + code[i + 1].item<float>()) * 0.5f;
        probe.insert(probe.end(), {m, std::nextafter(m, 2.0f), std::nextafter(m, -2.0f)});
      }
    }
    probe.insert(probe.end(), {0.0f, -0.0f, 1.0f, -1.0f, 1e-30f, -1e-30f});
    for (float v : probe) {
      ASSERT_EQ(lut.nearest(v), lut.nearest_by_search(v)) << "v = " << v;
      // And it is the nearest code (up to the float rounding of the midpoint).
      const int i = lut.nearest(v);
      const double d = std::fabs(double(v) - code[i].item<float>());
      if (i > 0) ASSERT_LE(d, std::fabs(double(v) - code[i - 1].item<float>()) + 1e-7) << v;
      if (i < 255) ASSERT_LE(d, std::fabs(double(v) - code[i + 1].item<float>()) + 1e-7) << v;
    }
  }
}

// Straightforward reference: the blocks of a rows x row_len tensor as lists of indices.
std::vector<std::vector<int64_t>> reference_blocks(BlockShape s, int64_t rows, int64_t row_len) {
  std::vector<std::vector<int64_t>> blocks;
  if (!s.is_tile()) {
    for (int64_t start = 0; start < rows * row_len; start += s.block) {
      blocks.emplace_back();
      for (int64_t e = start; e < std::min(rows * row_len, start + s.block); ++e) {
        blocks.back().push_back(e);
      }
    }
    return blocks;
  }
  for (int64_t r0 = 0; r0 < rows; r0 += s.tile_rows) {
    for (int64_t c0 = 0; c0 < row_len; c0 += s.tile_cols) {
      blocks.emplace_back();
      for (int64_t r = r0; r < std::min(rows, r0 + s.tile_rows); ++r) {
        for (int64_t c = c0; c < std::min(row_len, c0 + s.tile_cols); ++c) {
          blocks.back().push_back(r * row_len + c);
        }
      }
    }
  }
  return blocks;
}

TEST(Blockwise, QuantizeDequantizeEveryElementWithinTheBound) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  struct Case {
    int64_t rows, row_len;
    BlockShape shape;
  };
  const Case cases[] = {{37, 53, BlockShape::blocks(256)},  {64, 64, BlockShape::blocks(2048)},
                        {70, 45, BlockShape::tiles(32, 32)}, {9, 13, BlockShape::tiles(4, 5)},
                        {1, 300, BlockShape::blocks(256)},   {100, 1, BlockShape::blocks(7)}};
  testing::for_each_quant_isa([&](quant::cpu::Isa) {
  int c = 0;
  for (const Case& k : cases) {
    for (bool is_signed : {true, false}) {
      const at::Tensor code = dynamic_map(is_signed);
      const auto lut = code_lut(code);
      at::Tensor x = testing::seeded_randn({k.rows, k.row_len}, seed, c++);
      if (!is_signed) x = x.abs();
      x.view(-1)[0] = 0;  // a zero, and a block of zeros below when there is room
      const BlockLayout L(k.shape, k.rows, k.row_len);
      at::Tensor q = at::full({k.rows * k.row_len}, 0xAB, at::kByte);  // poison
      at::Tensor absmax = at::full({L.num_blocks}, -1.0f);
      ASSERT_TRUE(cpu::quantize(x.data_ptr<float>(), L, *lut, q.data_ptr<uint8_t>(),
                                absmax.data_ptr<float>()));
      at::Tensor out = at::full({k.rows * k.row_len}, std::numeric_limits<float>::quiet_NaN());
      cpu::dequantize(q.data_ptr<uint8_t>(), absmax.data_ptr<float>(), L, *lut,
                      out.data_ptr<float>());
      const auto blocks = reference_blocks(k.shape, k.rows, k.row_len);
      ASSERT_EQ(static_cast<int64_t>(blocks.size()), L.num_blocks);
      const float* xv = x.data_ptr<float>();
      const float* cv = code.data_ptr<float>();
      for (size_t b = 0; b < blocks.size(); ++b) {
        float amax = 0;
        for (int64_t e : blocks[b]) amax = std::max(amax, std::fabs(xv[e]));
        ASSERT_EQ(absmax[b].item<float>(), amax) << "block " << b;
        for (int64_t e : blocks[b]) {
          const int idx = q[e].item<uint8_t>();
          const double v = amax > 0 ? double(xv[e]) / amax : 0.0;
          // idx is a nearest code of x / absmax (to float rounding of the scaling) ...
          for (int j : {idx - 1, idx + 1}) {
            if (j < 0 || j > 255) continue;
            ASSERT_LE(std::fabs(v - cv[idx]), std::fabs(v - cv[j]) + 1e-6) << "element " << e;
          }
          // ... and dequantises to code * absmax, within half the gap around it.
          ASSERT_EQ(out[e].item<float>(), cv[idx] * amax) << "element " << e;
          const double gap = std::max(idx > 0 ? cv[idx] - cv[idx - 1] : 0.0,
                                      idx < 255 ? cv[idx + 1] - cv[idx] : 0.0);
          ASSERT_LE(std::fabs(out[e].item<float>() - xv[e]), 0.5 * gap * amax + 1e-6 * amax);
        }
      }
    }
  }
  });
}

TEST(Blockwise, AtenEntryPointsAndErrors) {
  const at::Tensor x = at::randn({10, 30});
  const at::Tensor code = dynamic_map(true);
  const Quantized q = quantize_blockwise(x, code, BlockShape::tiles(4, 8));
  EXPECT_EQ(q.codes.sizes(), x.sizes());
  EXPECT_EQ(q.absmax.numel(), 3 * 4);
  const at::Tensor back = dequantize_blockwise(q, code, BlockShape::tiles(4, 8));
  EXPECT_LE((back - x).abs().max().item<float>(), 0.02 * x.abs().max().item<float>());
  at::Tensor bad = x.clone();
  bad[3][4] = std::numeric_limits<float>::infinity();
  EXPECT_THROW(quantize_blockwise(bad, code, BlockShape::blocks(256)), std::invalid_argument);
  EXPECT_THROW(quantize_blockwise(x.to(at::kDouble), code, BlockShape::blocks(256)),
               std::invalid_argument);
  EXPECT_THROW(quantize_blockwise(x, code, BlockShape::blocks(0)), std::invalid_argument);
  EXPECT_THROW(dequantize_blockwise(q, code, BlockShape::blocks(256)), std::invalid_argument);
  EXPECT_THROW(quantize_blockwise(x, code.slice(0, 0, 100), BlockShape::blocks(256)),
               std::invalid_argument);
}

}  // namespace
}  // namespace rfsdp::quant
