#include "fsdp/comm_policy.h"

#include <stdexcept>

namespace rfsdp {

CommPolicy CommPolicy::parse(const std::optional<std::string>& weights, int64_t weight_block,
                             std::optional<at::ScalarType> gradients) {
  CommPolicy p;
  const std::string w = weights.value_or("full");
  if (w == "int8") {
    p.weights = WeightWire::kInt8;
  } else if (w == "float8_e4m3fn") {
    p.weights = WeightWire::kFloat8E4M3FN;
  } else if (w != "full" && w != "none") {
    throw std::invalid_argument("CommPolicy: weights='" + w + "' is not a weight format; use "
                                "None (the compute dtype), 'int8' or 'float8_e4m3fn'");
  }
  if (weight_block < 1) {
    throw std::invalid_argument("CommPolicy: weight_block=" + std::to_string(weight_block) +
                                " must be a positive number of elements (256 is the default)");
  }
  p.weight_block = weight_block;
  if (gradients && *gradients != at::kBFloat16) {
    throw std::invalid_argument(std::string("CommPolicy: gradients=") + c10::toString(*gradients) +
                                " is not supported; use None (the reduce dtype) or torch.bfloat16 "
                                "(sent in bfloat16, summed in float32)");
  }
  p.gradients = gradients;
  return p;
}

double CommPolicy::code_max() const {
  switch (weights) {
    case WeightWire::kInt8: return 127.0;
    case WeightWire::kFloat8E4M3FN: return 448.0;
    default: throw std::logic_error("CommPolicy::code_max: the weights travel in full");
  }
}

at::ScalarType CommPolicy::code_dtype() const {
  switch (weights) {
    case WeightWire::kInt8: return at::kChar;
    case WeightWire::kFloat8E4M3FN: return at::kFloat8_e4m3fn;
    default: return at::ScalarType::Undefined;
  }
}

std::string CommPolicy::weights_name() const {
  switch (weights) {
    case WeightWire::kInt8: return "int8";
    case WeightWire::kFloat8E4M3FN: return "float8_e4m3fn";
    default: return "full";
  }
}

std::string CommPolicy::describe() const {
  std::string s = "weights " + weights_name();
  if (quantised_weights()) s += " in blocks of " + std::to_string(weight_block);
  s += ", gradients ";
  s += gradients ? std::string(c10::toString(*gradients)) + " summed in float32" : "in the reduce dtype";
  return s;
}

void CommPolicy::check_plan(const Plan& plan) const {
  if (!quantised_weights()) return;
  const std::optional<BlockCut> cut = first_block_cut(plan, weight_block);
  if (!cut) return;
  const TensorSpec& t = plan.tensors[cut->tensor];
  const ShardRange s = plan.shard(cut->tensor, cut->rank);
  const std::string B = std::to_string(weight_block);
  throw std::invalid_argument(
      "comm_policy weights='" + weights_name() + "' with weight_block=" + B + ": tensor '" +
      t.name + "' (shape " + shape_to_string(t.shape) + ") is cut at element " +
      std::to_string(cut->element) + " (rank " + std::to_string(cut->rank) + "'s rows " +
      std::to_string(s.row_begin) + ".." + std::to_string(s.row_end) + "), inside a block of " + B +
      "; plan with a granule that keeps blocks whole (rfsdp.policy.blockwise_8bit(" + B + "), which "
      "fully_shard adds for a comm_policy), or choose a weight_block that divides the granule's "
      "elements");
}

}  // namespace rfsdp
