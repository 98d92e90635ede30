// The JSON forms of a unit (input to rfsdp-plan) and of a plan (its --json output).
#pragma once

#include <string>
#include <vector>

#include "core/ragged/plan.h"
#include "core/ragged/tensor_spec.h"

namespace rfsdp {

// Parses `[{"name", "shape", "granule_rows": int | "whole", "row_dims"?, "dtype_bytes"}]`.
// Throws std::invalid_argument with a one-line message naming the entry.
std::vector<TensorSpec> unit_from_json(const std::string& text);

// {"world_size", "S", "align_bytes", "padding_fraction", "lower_bound_S", "plan_seconds",
//  "tensors": [{"name", "shape", "row_dims", "granule_rows", "offset"}]}; sizes in elements.
std::string plan_to_json(const Plan& plan, int indent = -1);

}  // namespace rfsdp
