// The validator against hand-made plans: one valid, then one broken per constraint.
#include <gtest/gtest.h>

#include "core/ragged/plan.h"

namespace rfsdp {
namespace {

TensorSpec spec(const std::string& name, std::vector<int64_t> shape, int64_t g = 1) {
  TensorSpec t;
  t.name = name;
  t.shape = std::move(shape);
  t.granule_rows = g;
  t.elem_bytes = 4;
  return t;
}

// m = 2, S = 16 (fp32, 16-byte alignment = 4 elements).
// a: [3, 8] granule 1 row at 0 -> boundary 16 is 2 rows in: fine.
// b: [4] whole at 24 -> inside rank 1.
Plan good_plan() {
  Plan p;
  p.world_size = 2;
  p.shard_elems = 16;
  p.align_bytes = 16;
  p.elem_bytes = 4;
  p.tensors = {spec("a", {3, 8}), spec("b", {4}, kWholeTensor)};
  p.offsets = {0, 24};
  return p;
}

void expect_violation(const Plan& p, const std::string& tensor, const std::string& constraint) {
  const auto bad = plan_violations(p);
  ASSERT_FALSE(bad.empty()) << "expected a '" << constraint << "' violation";
  bool found = false;
  for (const auto& line : bad) {
    if (line.find(constraint) != std::string::npos &&
        (tensor.empty() || line.find("'" + tensor + "'") != std::string::npos)) {
      found = true;
    }
  }
  EXPECT_TRUE(found) << "no '" << constraint << "' for '" << tensor << "' in: " << bad.front();
  EXPECT_THROW(validate_plan(p), std::invalid_argument);
}

TEST(PlanValidator, AcceptsAValidPlan) {
  const Plan p = good_plan();
  EXPECT_TRUE(plan_violations(p).empty()) << plan_violations(p).front();
  EXPECT_NO_THROW(validate_plan(p));
  EXPECT_DOUBLE_EQ(p.padding_fraction(), (32.0 - 28.0) / 32.0);
  EXPECT_EQ(p.lower_bound_shard_elems(), 16);  // ceil(28 / 2) = 14 -> 16
}

TEST(PlanValidator, BoundaryInsideAGranule) {
  Plan p = good_plan();
  p.tensors[0].granule_rows = 3;  // whole: boundary 16 cuts it
  expect_violation(p, "a", "granule");
  p = good_plan();
  p.offsets[0] = 4;  // boundary 16 now 12 elements in: 1.5 rows
  expect_violation(p, "a", "granule");
}

TEST(PlanValidator, WholeTensorSplit) {
  Plan p = good_plan();
  p.world_size = 3;
  p.tensors[1] = spec("b", {8}, kWholeTensor);
  p.offsets[1] = 24;  // [24, 32): inside rank 1
  EXPECT_TRUE(plan_violations(p).empty());
  p.offsets[1] = 28;  // [28, 36): boundary 32 cuts the whole tensor
  expect_violation(p, "b", "granule");
}

TEST(PlanValidator, MisalignedOffsetAndS) {
  Plan p = good_plan();
  p.offsets[1] = 26;
  expect_violation(p, "b", "alignment");
  p = good_plan();
  p.shard_elems = 18;  // not a multiple of 4 elements
  expect_violation(p, "", "alignment: S");
}

TEST(PlanValidator, Overlap) {
  Plan p = good_plan();
  p.offsets[1] = 20;  // a covers [0, 24)
  expect_violation(p, "b", "overlap");
}

TEST(PlanValidator, OutOfBoundsAndNegative) {
  Plan p = good_plan();
  p.offsets[1] = 32;
  expect_violation(p, "b", "bounds");
  p.offsets[1] = -4;
  expect_violation(p, "b", "bounds");
}

TEST(PlanValidator, BadSpecsAndShapes) {
  Plan p = good_plan();
  p.tensors[1].shape = {0};
  expect_violation(p, "b", "dim 0 is 0");
  p = good_plan();
  p.tensors[1].name = "a";
  expect_violation(p, "a", "duplicate");
  p = good_plan();
  p.offsets.pop_back();
  expect_violation(p, "", "offsets for 2 tensors");
  p = good_plan();
  p.tensors[1].elem_bytes = 2;
  expect_violation(p, "b", "dtype_bytes");
  p = good_plan();
  p.world_size = 0;
  expect_violation(p, "", "world_size");
}

TEST(PlanValidator, ShardRangesOfTheGoodPlan) {
  const Plan p = good_plan();
  const ShardRange a0 = p.shard(0, 0), a1 = p.shard(0, 1), b0 = p.shard(1, 0), b1 = p.shard(1, 1);
  EXPECT_EQ(a0.row_begin, 0);
  EXPECT_EQ(a0.row_end, 2);
  EXPECT_EQ(a0.local_offset, 0);
  EXPECT_EQ(a1.row_begin, 2);
  EXPECT_EQ(a1.row_end, 3);
  EXPECT_EQ(a1.local_offset, 0);
  EXPECT_EQ(a1.numel, 8);
  EXPECT_TRUE(b0.empty());
  EXPECT_EQ(b1.row_begin, 0);
  EXPECT_EQ(b1.row_end, 4);
  EXPECT_EQ(b1.local_offset, 8);
  EXPECT_THROW(p.shard(0, 2), std::out_of_range);
}

// Two buffers, m = 2: buffer 0 (S_0 = 12) holds a [6, 4] at 0 (boundary 12 is 3
// rows in); buffer 1 (S_1 = 8) holds c [2, 8] at 0 (boundary 8 is 1 row in).
// A rank's slice: 12 elements of buffer 0, then 8 of buffer 1.
Plan two_buffer_plan() {
  Plan p;
  p.world_size = 2;
  p.shard_elems = 20;
  p.buffer_shard_elems = {12, 8};
  p.align_bytes = 16;
  p.elem_bytes = 4;
  p.tensors = {spec("a", {6, 4}), spec("c", {2, 8})};
  p.buffer_of = {0, 1};
  p.offsets = {0, 0};  // both at the start of their own buffer: no overlap
  return p;
}

TEST(PlanValidator, SeveralBuffers) {
  const Plan p = two_buffer_plan();
  ASSERT_TRUE(plan_violations(p).empty()) << plan_violations(p).front();
  EXPECT_EQ(p.num_buffers(), 2u);
  EXPECT_EQ(p.buffer_elems(), 40);
  EXPECT_EQ(p.global_offset(1), 24);  // after buffer 0's 2 x 12
  const ShardRange c1 = p.shard(1, 1);
  EXPECT_EQ(c1.row_begin, 1);
  EXPECT_EQ(c1.row_end, 2);
  EXPECT_EQ(c1.local_offset, 12);  // buffer 1 starts 12 elements into the slice
  const ShardRange a1 = p.shard(0, 1);
  EXPECT_EQ(a1.row_begin, 3);
  EXPECT_EQ(a1.local_offset, 0);
  EXPECT_DOUBLE_EQ(p.padding_fraction(), (40.0 - 40.0) / 40.0);

  Plan q = p;
  q.buffer_shard_elems = {12, 12};  // no longer adds up to S
  expect_violation(q, "", "add up to");
  q = p;
  q.buffer_of = {0, 2};
  expect_violation(q, "c", "does not exist");
  q = p;
  q.buffer_of = {0};
  expect_violation(q, "", "buffer indices");
  q = p;
  q.offsets[1] = 4;  // c [4, 20) in buffer 1 of 16 elements
  expect_violation(q, "c", "bounds");
  q = p;
  q.buffer_of = {0, 0};  // both in buffer 0 at offset 0: overlap
  q.offsets = {0, 0};
  expect_violation(q, "", "overlap");
  q = p;
  q.buffer_shard_elems = {10, 10};  // S_0 = 10: not a multiple of 4 elements
  expect_violation(q, "", "alignment");
  q = p;
  q.tensors[0].granule_rows = 2;  // buffer 0's boundary 12 is 3 rows into a
  expect_violation(q, "a", "granule");
}

}  // namespace
}  // namespace rfsdp
