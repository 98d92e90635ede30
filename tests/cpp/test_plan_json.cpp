#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/ragged/plan_json.h"
#include "core/ragged/planner.h"

namespace rfsdp {
namespace {

TEST(PlanJson, ParsesUnit) {
  const auto unit = unit_from_json(R"([
    {"name": "w", "shape": [6, 4], "granule_rows": 2, "dtype_bytes": 2},
    {"name": "e", "shape": [2, 3, 4], "granule_rows": "whole", "row_dims": 2, "dtype_bytes": 2}])");
  ASSERT_EQ(unit.size(), 2u);
  EXPECT_EQ(unit[0].name, "w");
  EXPECT_EQ(unit[0].shape, (std::vector<int64_t>{6, 4}));
  EXPECT_EQ(unit[0].granule_rows, 2);
  EXPECT_EQ(unit[0].row_dims, 1);
  EXPECT_EQ(unit[0].elem_bytes, 2);
  EXPECT_TRUE(unit[1].is_whole());
  EXPECT_EQ(unit[1].row_dims, 2);
  EXPECT_EQ(unit[1].rows(), 6);
}

void expect_parse_error(const std::string& text, const std::string& needle) {
  try {
    unit_from_json(text);
    FAIL() << "no error for " << text;
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
  }
}

TEST(PlanJson, BadInput) {
  expect_parse_error("[{", "not valid JSON");
  expect_parse_error("{}", "list of tensors");
  expect_parse_error(R"([{"shape": [2], "granule_rows": 1, "dtype_bytes": 2}])", "\"name\"");
  expect_parse_error(R"([{"name": "w", "granule_rows": 1, "dtype_bytes": 2}])", "'w': needs \"shape\"");
  expect_parse_error(R"([{"name": "w", "shape": [2], "granule_rows": "half", "dtype_bytes": 2}])",
                     "'w': granule_rows must be a positive integer or \"whole\"");
  expect_parse_error(R"([{"name": "w", "shape": [2], "granule_rows": 1.5, "dtype_bytes": 2}])",
                     "'w': granule_rows must be a positive integer");
  expect_parse_error(R"([{"name": "w", "shape": [2], "granule_rows": 0, "dtype_bytes": 2}])",
                     "'w': granule_rows must be a positive integer");
  expect_parse_error(R"([{"name": "w", "shape": [2, 0], "granule_rows": 1, "dtype_bytes": 2}])",
                     "'w': dim 1 is 0");
  expect_parse_error(R"([{"name": "w", "shape": [2], "granule_rows": 1, "row_dims": 2, "dtype_bytes": 2}])",
                     "'w': row_dims 2 is out of range");
  expect_parse_error(R"([{"name": "w", "shape": [2], "granule_rows": 1}])", "'w': needs \"dtype_bytes\"");
  expect_parse_error(R"([{"name": "w", "shape": [2], "granule_rows": 1, "dtype_bytes": 2, "x": 1}])",
                     "'w': unknown field \"x\"");
}

TEST(PlanJson, PlanOutputHasTheDocumentedFields) {
  const auto unit = unit_from_json(R"([
    {"name": "w", "shape": [6, 4], "granule_rows": 2, "dtype_bytes": 4},
    {"name": "b", "shape": [5], "granule_rows": "whole", "dtype_bytes": 4}])");
  const Plan p = plan_unit(unit, 3, 16);
  const auto j = nlohmann::json::parse(plan_to_json(p));
  EXPECT_EQ(j["world_size"], 3);
  EXPECT_EQ(j["S"], p.shard_elems);
  EXPECT_EQ(j["align_bytes"], 16);
  EXPECT_DOUBLE_EQ(j["padding_fraction"].get<double>(), p.padding_fraction());
  EXPECT_EQ(j["lower_bound_S"], p.lower_bound_shard_elems());
  EXPECT_TRUE(j["plan_seconds"].is_number());
  ASSERT_EQ(j["tensors"].size(), 2u);
  EXPECT_EQ(j["tensors"][0]["name"], "w");
  EXPECT_EQ(j["tensors"][0]["shape"], nlohmann::json({6, 4}));
  EXPECT_EQ(j["tensors"][0]["row_dims"], 1);
  EXPECT_EQ(j["tensors"][0]["granule_rows"], 2);
  EXPECT_EQ(j["tensors"][0]["offset"], p.offsets[0]);
  EXPECT_EQ(j["tensors"][1]["granule_rows"], "whole");
  EXPECT_EQ(j["tensors"][1]["offset"], p.offsets[1]);
}

}  // namespace
}  // namespace rfsdp
