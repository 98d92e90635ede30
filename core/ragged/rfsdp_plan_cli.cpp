// rfsdp-plan: plan one unit from a JSON list of tensors (file or stdin).
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>

#include "rfsdp_version.h"  // generated (cmake/rfsdp_version.h.in)
#include "core/ragged/plan_json.h"
#include "core/ragged/planner.h"

namespace {

const char* kUsage =
    "usage: rfsdp-plan [FILE] --world-size M [--align-bytes A] [--max-buffers K]\n"
    "                  [--collective-cost-bytes C] [--weight-block B] [--json] | --version\n"
    "  FILE: JSON list of tensors [{\"name\", \"shape\", \"granule_rows\": int | \"whole\",\n"
    "        \"row_dims\" (default 1), \"dtype_bytes\"}]; stdin when absent or \"-\".\n"
    "  K: at most this many buffers (collectives) per unit (default 4; 1: one buffer);\n"
    "  C: a collective's fixed cost as bytes received (latency x bandwidth; default 1 MiB).\n";

int64_t parse_int(const std::string& flag, const char* text) {
  if (text == nullptr) throw std::invalid_argument(flag + " needs a value");
  char* end = nullptr;
  const long long v = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0') {
    throw std::invalid_argument(flag + " takes an integer, got '" + text + "'");
  }
  return v;
}

void print_table(const rfsdp::Plan& plan) {
  std::printf("world size %lld, S = %lld elements per rank (lower bound %lld, +%.3f%%), "
              "padding %.3f%%, align %lld bytes, planned in %.2f ms\n",
              static_cast<long long>(plan.world_size), static_cast<long long>(plan.shard_elems),
              static_cast<long long>(plan.lower_bound_shard_elems()),
              100.0 * (static_cast<double>(plan.shard_elems) / plan.lower_bound_shard_elems() - 1.0),
              100.0 * plan.padding_fraction(), static_cast<long long>(plan.align_bytes),
              plan.plan_seconds * 1e3);
  if (plan.num_buffers() > 1) {
    std::printf("%zu buffers (one collective each), S per buffer:", plan.num_buffers());
    for (size_t b = 0; b < plan.num_buffers(); ++b) {
      std::printf(" %lld", static_cast<long long>(plan.buffer_shard(b)));
    }
    std::printf("\n");
  }
  std::printf("%-40s %-22s %5s %8s %3s %14s %7s %7s\n", "tensor", "shape", "rdims", "granule",
              "buf", "offset", "rank0", "rankN");
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const auto& t = plan.tensors[i];
    const int64_t off = plan.offsets[i];
    const size_t b = plan.buffer_index(i);
    const int64_t S = plan.buffer_shard(b);
    std::printf("%-40s %-22s %5d %8s %3zu %14lld %7lld %7lld\n", t.name.c_str(),
                rfsdp::shape_to_string(t.shape).c_str(), t.row_dims,
                rfsdp::granule_to_string(t).c_str(), b, static_cast<long long>(off),
                static_cast<long long>(off / S), static_cast<long long>((off + t.numel() - 1) / S));
  }
}

// What one training step sends from each rank (a gather for forward, one for
// backward, a reduce-scatter: this rank's slice to each of the m-1 others)
// under each communication policy (fsdp/comm_policy.h): weights in the plan's
// element size, bf16, or block codes (1 byte an element and one fp32 scale a
// block of B, which the plan must keep whole); gradients in fp32 or bf16.
void print_comm_table(const rfsdp::Plan& plan, int64_t block) {
  const double m1 = static_cast<double>(plan.world_size - 1), S = static_cast<double>(plan.shard_elems);
  const std::vector<int64_t> slots = rfsdp::block_slots(plan, block);
  double K = 0;
  for (int64_t k : slots) K += static_cast<double>(k);
  const bool whole = !rfsdp::first_block_cut(plan, block).has_value();
  const double mib = 1.0 / (1 << 20);
  std::printf("\nbytes sent per rank per step (2 all-gathers + 1 reduce-scatter), by communication policy:\n");
  std::printf("%-34s %14s %14s %14s\n", "weights / gradients", "gathers MiB", "reduce MiB", "total MiB");
  struct Row { std::string name; double weight_bytes; bool codes; };
  const std::vector<Row> rows = {{"elements of " + std::to_string(plan.elem_bytes) + " bytes", 1.0 * plan.elem_bytes, false},
                                 {"bfloat16", 2.0, false},
                                 {"int8 / float8 codes, blocks of " + std::to_string(block), 1.0, true}};
  for (const Row& r : rows) {
    for (double g : {4.0, 2.0}) {
      const std::string name = r.name + (g == 4.0 ? " / fp32" : " / bf16");
      if (r.codes && !whole) {
        std::printf("%-34s %14s (the plan cuts blocks of %lld: plan with that granule)\n",
                    name.c_str(), "n/a", static_cast<long long>(block));
        continue;
      }
      const double gathers = 2 * m1 * (S * r.weight_bytes + (r.codes ? 4 * K : 0)) * mib;
      const double reduce = m1 * S * g * mib;
      std::printf("%-34s %14.3f %14.3f %14.3f\n", name.c_str(), gathers, reduce, gathers + reduce);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::string path;
    int64_t world_size = 0, align_bytes = 16;
    bool have_world_size = false;
    bool as_json = false;
    int64_t weight_block = 256;  // the weights' code blocks in the bytes table
    rfsdp::PlannerOptions options;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--world-size") {
        world_size = parse_int(a, i + 1 < argc ? argv[++i] : nullptr);
        have_world_size = true;
      } else if (a == "--align-bytes") {
        align_bytes = parse_int(a, i + 1 < argc ? argv[++i] : nullptr);
        if (align_bytes < 1) throw std::invalid_argument("--align-bytes must be positive");
      } else if (a == "--max-buffers") {
        options.max_buffers = static_cast<int>(parse_int(a, i + 1 < argc ? argv[++i] : nullptr));
        if (options.max_buffers < 1) throw std::invalid_argument("--max-buffers must be >= 1");
      } else if (a == "--collective-cost-bytes") {
        options.collective_cost_bytes = parse_int(a, i + 1 < argc ? argv[++i] : nullptr);
        if (options.collective_cost_bytes < 0) {
          throw std::invalid_argument("--collective-cost-bytes must be >= 0");
        }
      } else if (a == "--weight-block") {
        weight_block = parse_int(a, i + 1 < argc ? argv[++i] : nullptr);
        if (weight_block < 1) throw std::invalid_argument("--weight-block must be positive");
      } else if (a == "--json") {
        as_json = true;
      } else if (a == "--version") {
        std::cout << "rfsdp-plan (RaggedFSDP) " << RFSDP_VERSION << "\n";
        return 0;
      } else if (a == "-h" || a == "--help") {
        std::cout << kUsage;
        return 0;
      } else if (!a.empty() && a[0] == '-' && a != "-") {
        throw std::invalid_argument("unknown option '" + a + "' (see --help)");
      } else if (path.empty()) {
        path = a;
      } else {
        throw std::invalid_argument("more than one input file given");
      }
    }
    if (!have_world_size) throw std::invalid_argument("--world-size M is required");
    std::stringstream buf;
    if (path.empty() || path == "-") {
      buf << std::cin.rdbuf();
    } else {
      std::ifstream in(path);
      if (!in) throw std::invalid_argument("cannot read '" + path + "'");
      buf << in.rdbuf();
    }
    const rfsdp::Plan plan =
        rfsdp::plan_unit(rfsdp::unit_from_json(buf.str()), world_size, align_bytes, options);
    rfsdp::validate_plan(plan);
    if (as_json) {
      std::cout << rfsdp::plan_to_json(plan) << "\n";
    } else {
      print_table(plan);
      print_comm_table(plan, weight_block);
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "rfsdp-plan: error: " << e.what() << "\n";
    return 2;
  }
}
