// How a unit's collectives carry its data: the weights' all-gather in full
// (the compute dtype) or as block codes and scales, the gradients' reduce in
// the reduce dtype or as bfloat16 pieces summed in fp32 on the rank that owns
// them. Nothing of it is state: a checkpoint saved under one policy loads under any.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

#include "core/ragged/plan.h"

namespace rfsdp {

enum class WeightWire { kFull, kInt8, kFloat8E4M3FN };

struct CommPolicy {
  WeightWire weights = WeightWire::kFull;
  // Weight codes: blocks of this many consecutive elements of each tensor,
  // counted from the global tensor's start; one fp32 scale each.
  int64_t weight_block = 256;
  // Set (bfloat16): gradients travel in it and are summed in fp32.
  std::optional<at::ScalarType> gradients;

  // From Python's words: weights None / "int8" / "float8_e4m3fn"; gradients
  // None / bfloat16. Anything else is an std::invalid_argument naming what fits.
  static CommPolicy parse(const std::optional<std::string>& weights, int64_t weight_block,
                          std::optional<at::ScalarType> gradients);

  bool quantised_weights() const { return weights != WeightWire::kFull; }
  // The largest code magnitude: 127 (int8), 448 (float8_e4m3fn's largest finite).
  double code_max() const;
  // The codes' dtype (int8, float8_e4m3fn); undefined for kFull.
  at::ScalarType code_dtype() const;
  std::string weights_name() const;  // "full", "int8", "float8_e4m3fn"
  // One line for messages and the ranks' agreement.
  std::string describe() const;
  bool operator==(const CommPolicy& o) const {
    return weights == o.weights && (!quantised_weights() || weight_block == o.weight_block) &&
           gradients == o.gradients;
  }

  // Throws std::invalid_argument unless every rank's piece of every tensor of
  // `plan` starts on a block edge of its tensor (and so ends on one or at the
  // tensor's end): what lets each rank encode its own blocks alone. Names the
  // first tensor cut inside a block, and the granule that keeps blocks whole.
  void check_plan(const Plan& plan) const;
};

}  // namespace rfsdp
