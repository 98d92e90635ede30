#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <random>
#include <stdexcept>

#include "core/ragged/plan_json.h"
#include "core/ragged/tensor_shard.h"
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

// Logical blocks (Muon's split) travel through the JSON, the plan keeps them
// whole (a granule that would cut one is refused, naming the one to use), and
// every rank's shard carries them.
TEST(PlanJson, LogicalBlocksTravelToTheShardsAndAreNeverCut) {
  const auto unit = unit_from_json(R"([
    {"name": "qkv", "shape": [48, 16], "granule_rows": "whole", "dtype_bytes": 4, "blocks": [32, 8, 8]},
    {"name": "heads", "shape": [32, 16], "granule_rows": 8, "dtype_bytes": 4, "blocks": [8, 8, 8, 8]},
    {"name": "b", "shape": [16], "granule_rows": 1, "dtype_bytes": 4}])");
  ASSERT_EQ(unit[0].blocks, (std::vector<int64_t>{32, 8, 8}));
  const Plan p = plan_unit(unit, 3);
  const auto j = nlohmann::json::parse(plan_to_json(p));
  EXPECT_EQ(j["tensors"][1]["blocks"], nlohmann::json::parse("[8, 8, 8, 8]"));
  EXPECT_FALSE(j["tensors"][2].contains("blocks"));
  for (int64_t r = 0; r < 3; ++r) {
    const TensorShard s = TensorShard::of_plan(p, 1, r);
    EXPECT_EQ(s.blocks, (std::vector<int64_t>{8, 8, 8, 8}));
    EXPECT_EQ(s.row_begin % 8, 0);
  }
  EXPECT_THROW(unit_from_json(R"([{"name": "w", "shape": [16, 4], "granule_rows": 4,
                                   "dtype_bytes": 4, "blocks": [8, 8]}])"), std::invalid_argument);
  EXPECT_THROW(unit_from_json(R"([{"name": "w", "shape": [16, 4], "granule_rows": 8,
                                   "dtype_bytes": 4, "blocks": [8, 6]}])"), std::invalid_argument);
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
  ASSERT_EQ(j["buffers"].size(), 1u);
  EXPECT_EQ(j["buffers"][0]["S"], p.shard_elems);
  EXPECT_EQ(j["tensors"][0]["buffer"], 0);
  // Several buffers: each with its S, each tensor with its buffer and its offset in it.
  PlannerOptions free_collectives;
  free_collectives.collective_cost_bytes = 0;
  const Plan two = plan_unit(unit_from_json(R"([
    {"name": "a", "shape": [64, 7], "granule_rows": 1, "dtype_bytes": 4},
    {"name": "b", "shape": [64, 9], "granule_rows": 1, "dtype_bytes": 4}])"), 8, 16,
                             free_collectives);
  ASSERT_EQ(two.num_buffers(), 2u);
  const auto k = nlohmann::json::parse(plan_to_json(two));
  ASSERT_EQ(k["buffers"].size(), 2u);
  int64_t sum = 0;
  for (size_t b = 0; b < 2; ++b) {
    EXPECT_EQ(k["buffers"][b]["S"], two.buffer_shard(b));
    sum += k["buffers"][b]["S"].get<int64_t>();
  }
  EXPECT_EQ(k["S"], sum);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(k["tensors"][i]["buffer"], two.buffer_index(i));
    EXPECT_EQ(k["tensors"][i]["offset"], two.offsets[i]);
  }
}

// A random-property test in place of a fuzzer (the machine's compiler is gcc): a
// valid unit mutated thousands of ways (bytes replaced by JSON's own characters
// and digits, slices dropped or repeated, cut short, numbers made huge or
// negative) is either parsed, and then planned or refused by the planner, or
// refused with std::invalid_argument naming what was wrong; never a crash or
// another exception. A fresh seed each run, printed on failure.
TEST(PlanJson, RandomMutationsAreParsedOrRefusedNeverCrash) {
  const std::string valid = R"([{"name": "w", "shape": [6, 4], "granule_rows": 2, "dtype_bytes": 2},
    {"name": "e", "shape": [2, 3, 4], "granule_rows": "whole", "row_dims": 2, "dtype_bytes": 4},
    {"name": "b", "shape": [5], "granule_rows": 1, "dtype_bytes": 4}])";
  const uint64_t seed = std::random_device{}();
  std::mt19937_64 rng(seed);
  const std::string alphabet = "{}[]:,\"0123456789-+.eE tfnlruasw";
  const std::vector<std::string> numbers = {"0", "-1", "1e30", "9223372036854775807",
                                            "99999999999999999999", "1.5", "-0", "4294967297"};
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % std::max<size_t>(n, 1)); };
  int parsed = 0, planned = 0, refused = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    std::string text = valid;
    const int edits = 1 + static_cast<int>(pick(4));
    for (int k = 0; k < edits && !text.empty(); ++k) {
      const size_t at = pick(text.size());
      switch (pick(5)) {
        case 0: text[at] = alphabet[pick(alphabet.size())]; break;
        case 1: text.erase(at, 1 + pick(8)); break;
        case 2: text.insert(at, text.substr(pick(text.size()), 1 + pick(12))); break;
        case 3: text.resize(at); break;
        default: {  // a number somewhere becomes another
          const size_t d = text.find_first_of("0123456789", at);
          if (d != std::string::npos) {
            const size_t e = text.find_first_not_of("0123456789", d);
            text.replace(d, (e == std::string::npos ? text.size() : e) - d,
                         numbers[pick(numbers.size())]);
          }
        }
      }
    }
    std::vector<TensorSpec> unit;
    try {
      unit = unit_from_json(text);
    } catch (const std::invalid_argument& e) {
      ++refused;
      EXPECT_GT(std::string(e.what()).size(), 10u) << "seed " << seed << ": " << text;
      continue;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "seed " << seed << ": not std::invalid_argument (" << e.what()
                    << ") for " << text;
      continue;
    }
    ++parsed;
    try {
      plan_unit(unit, 1 + static_cast<int64_t>(pick(8)), 16);
      ++planned;
    } catch (const std::invalid_argument&) {
    } catch (const std::exception& e) {
      ADD_FAILURE() << "seed " << seed << ": the planner threw " << e.what() << " for " << text;
    }
  }
  EXPECT_GT(parsed, 0) << "seed " << seed;
  EXPECT_GT(refused, 0) << "seed " << seed;
  RecordProperty("parsed", parsed);
  RecordProperty("planned", planned);
}

}  // namespace
}  // namespace rfsdp
