#include <gtest/gtest.h>

#include <stdexcept>

#include "core/ragged/tensor_spec.h"

namespace rfsdp {
namespace {

TensorSpec spec(std::vector<int64_t> shape, int row_dims = 1, int64_t g = 1) {
  TensorSpec t;
  t.name = "w";
  t.shape = std::move(shape);
  t.row_dims = row_dims;
  t.granule_rows = g;
  return t;
}

TEST(TensorSpec, RowsOfMatrixVectorAndExpertStack) {
  auto m = spec({6, 5});
  EXPECT_EQ(m.rows(), 6);
  EXPECT_EQ(m.row_elems(), 5);
  auto v = spec({7});
  EXPECT_EQ(v.rows(), 7);
  EXPECT_EQ(v.row_elems(), 1);
  auto e = spec({3, 4, 5}, 2);  // [E, H, I]: E*H rows of I
  EXPECT_EQ(e.rows(), 12);
  EXPECT_EQ(e.row_elems(), 5);
  auto s = spec({});
  EXPECT_EQ(s.rows(), 1);
  EXPECT_EQ(s.numel(), 1);
}

TEST(TensorSpec, GranuleAtOrAboveRowsIsWhole) {
  auto t = spec({6, 5}, 1, 4);
  EXPECT_FALSE(t.is_whole());
  EXPECT_EQ(t.granule_elems(), 20);
  t.granule_rows = 6;
  EXPECT_TRUE(t.is_whole());
  t.granule_rows = kWholeTensor;
  EXPECT_TRUE(t.is_whole());
  EXPECT_EQ(t.granule_elems(), 30);
  EXPECT_EQ(granule_to_string(t), "whole");
}

TEST(TensorSpec, CombineByLcmCappedAtWhole) {
  EXPECT_EQ(combine_granules(1024, 32, 100000), 1024);  // Shampoo block + quant tile
  EXPECT_EQ(combine_granules(6, 4, 100), 12);
  EXPECT_EQ(combine_granules(6, 4, 12), kWholeTensor);  // lcm reaches the rows
  EXPECT_EQ(combine_granules(kWholeTensor, 4, 100), kWholeTensor);
  EXPECT_EQ(combine_granules(int64_t{1} << 40, (int64_t{1} << 40) - 1, int64_t{1} << 50),
            kWholeTensor);  // lcm would overflow past the rows
  EXPECT_THROW(combine_granules(0, 4, 100), std::invalid_argument);
}

void expect_error(const TensorSpec& t, const std::string& needle) {
  try {
    check_tensor_spec(t);
    FAIL() << "no error for " << needle;
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'" + t.name + "'"), std::string::npos) << msg;
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "one line: " << msg;
  }
}

TEST(TensorSpec, BadSpecsNameTheTensor) {
  expect_error(spec({4, 0}), "dim 1 is 0");
  expect_error(spec({-3}), "dim 0 is -3");
  expect_error(spec({4, 5}, 3), "row_dims 3 is out of range");
  expect_error(spec({4, 5}, 0), "row_dims 0 is out of range");
  expect_error(spec({4, 5}, 1, 0), "granule_rows must be a positive integer");
  expect_error(spec({4, 5}, 1, -2), "granule_rows must be a positive integer");
  auto t = spec({4});
  t.elem_bytes = 0;
  expect_error(t, "dtype_bytes");
}

TEST(TensorSpec, UnitChecks) {
  EXPECT_THROW(check_unit_specs({}), std::invalid_argument);
  auto a = spec({4}), b = spec({5});
  try {
    check_unit_specs({a, b});
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("duplicate"), std::string::npos);
  }
  b.name = "b";
  b.elem_bytes = 2;
  try {
    check_unit_specs({a, b});
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'b'"), std::string::npos);
  }
  b.elem_bytes = 4;
  EXPECT_NO_THROW(check_unit_specs({a, b}));
}

}  // namespace
}  // namespace rfsdp
