#include "core/ragged/plan_json.h"

#include <nlohmann/json.hpp>

#include <limits>
#include <stdexcept>

namespace rfsdp {

namespace {

using json = nlohmann::json;

int64_t require_int(const json& v, const std::string& where) {
  // (JSON integers above 2^63 - 1 parse as unsigned: get<int64_t> would wrap them)
  if (!v.is_number_integer() ||
      (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t{std::numeric_limits<int64_t>::max()})) {
    throw std::invalid_argument(where + " must be an integer in [-2^63, 2^63), got " + v.dump());
  }
  return v.get<int64_t>();
}

TensorSpec tensor_from_json(const json& e, size_t index) {
  const std::string entry = "tensor #" + std::to_string(index);
  if (!e.is_object()) throw std::invalid_argument(entry + " is not a JSON object");
  if (!e.contains("name") || !e["name"].is_string()) {
    throw std::invalid_argument(entry + " needs a string \"name\"");
  }
  TensorSpec t;
  t.name = e["name"].get<std::string>();
  const std::string who = "tensor '" + t.name + "': ";
  for (const auto& [key, value] : e.items()) {
    (void)value;
    if (key != "name" && key != "shape" && key != "granule_rows" && key != "row_dims" &&
        key != "dtype_bytes" && key != "blocks" && key != "blocks_dim") {
      throw std::invalid_argument(who + "unknown field \"" + key + "\"");
    }
  }
  if (!e.contains("shape") || !e["shape"].is_array()) {
    throw std::invalid_argument(who + "needs \"shape\": a list of integers");
  }
  for (const json& d : e["shape"]) t.shape.push_back(require_int(d, who + "shape entries"));
  if (!e.contains("dtype_bytes")) throw std::invalid_argument(who + "needs \"dtype_bytes\"");
  t.elem_bytes = require_int(e["dtype_bytes"], who + "dtype_bytes");
  if (e.contains("row_dims")) {
    const int64_t r = require_int(e["row_dims"], who + "row_dims");
    // (check_tensor_spec checks the range; a cast to int would wrap 2^32 + 1 into it)
    if (r < std::numeric_limits<int>::min() || r > std::numeric_limits<int>::max()) {
      throw std::invalid_argument(who + "row_dims " + std::to_string(r) + " is out of range");
    }
    t.row_dims = static_cast<int>(r);
  }
  if (!e.contains("granule_rows")) {
    throw std::invalid_argument(who + "needs \"granule_rows\": a positive integer or \"whole\"");
  }
  const json& g = e["granule_rows"];
  if (g.is_string() && g.get<std::string>() == "whole") {
    t.granule_rows = kWholeTensor;
  } else if (g.is_number_integer()) {
    t.granule_rows = require_int(g, who + "granule_rows");
  } else {
    throw std::invalid_argument(who + "granule_rows must be a positive integer or \"whole\", got " +
                                g.dump());
  }
  if (e.contains("blocks")) {
    if (!e["blocks"].is_array()) throw std::invalid_argument(who + "blocks must be a list of row counts");
    for (const json& b : e["blocks"]) t.blocks.push_back(require_int(b, who + "blocks entries"));
  }
  if (e.contains("blocks_dim")) t.blocks_dim = static_cast<int>(require_int(e["blocks_dim"], who + "blocks_dim"));
  check_tensor_spec(t);
  return t;
}

}  // namespace

std::vector<TensorSpec> unit_from_json(const std::string& text) {
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::parse_error& e) {
    throw std::invalid_argument(std::string("input is not valid JSON: ") + e.what());
  } catch (const json::out_of_range& e) {  // a number beyond double's range (found by fuzzing)
    throw std::invalid_argument(std::string("input holds a number out of range: ") + e.what());
  }
  if (!doc.is_array()) throw std::invalid_argument("input must be a JSON list of tensors");
  std::vector<TensorSpec> tensors;
  for (size_t i = 0; i < doc.size(); ++i) tensors.push_back(tensor_from_json(doc[i], i));
  return tensors;
}

std::string plan_to_json(const Plan& plan, int indent) {
  using ojson = nlohmann::ordered_json;  // keeps the documented field order
  ojson tensors = ojson::array();
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const TensorSpec& t = plan.tensors[i];
    ojson g = t.is_whole() ? ojson("whole") : ojson(t.effective_granule_rows());
    ojson e = {{"name", t.name},
               {"shape", t.shape},
               {"row_dims", t.row_dims},
               {"granule_rows", g},
               {"buffer", plan.buffer_index(i)},
               {"offset", plan.offsets[i]}};
    if (!t.blocks.empty()) e["blocks"] = t.blocks;
    if (t.blocks_dim != 0) e["blocks_dim"] = t.blocks_dim;
    tensors.push_back(e);
  }
  ojson buffers = ojson::array();
  for (size_t b = 0; b < plan.num_buffers(); ++b) buffers.push_back({{"S", plan.buffer_shard(b)}});
  ojson out = {{"world_size", plan.world_size},
              {"S", plan.shard_elems},
              {"buffers", buffers},
              {"align_bytes", plan.align_bytes},
              {"padding_fraction", plan.padding_fraction()},
              {"lower_bound_S", plan.lower_bound_shard_elems()},
              {"plan_seconds", plan.plan_seconds},
              {"tensors", tensors}};
  return out.dump(indent);
}

}  // namespace rfsdp
