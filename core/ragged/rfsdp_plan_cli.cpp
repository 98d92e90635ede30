// rfsdp-plan: plan one unit from a JSON list of tensors (file or stdin).
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <vector>
#include <stdexcept>
#include <string>

#include "rfsdp_version.h"  // generated (cmake/rfsdp_version.h.in)
#include "core/ragged/plan_json.h"
#include "core/ragged/planner.h"
#include "core/ragged/step_model.h"

namespace {

// The defaults and limits printed are the planner's own (core/ragged/planner.h).
std::string usage() {
  const rfsdp::PlannerOptions defaults;
  const auto log2 = [](int64_t v) { return "2^" + std::to_string(63 - __builtin_clzll(v)); };
  return "usage: rfsdp-plan [FILE] --world-size M [--align-bytes A] [--max-buffers K]\n"
         "                  [--collective-cost-bytes C] [--weight-block B] [--json]\n"
         "                  [--report [--layers L] [--node-size N] [--intra-gbps X] [--inter-gbps Y]\n"
         "                   [--intra-latency-us U] [--inter-latency-us V] [--hbm-gbps H]] | --version\n"
         "  FILE: JSON list of tensors [{\"name\", \"shape\", \"granule_rows\": int | \"whole\",\n"
         "        \"row_dims\" (default 1), \"dtype_bytes\"}]; stdin when absent or \"-\".\n"
         "  M: 1 .. " + log2(rfsdp::kMaxWorldSize) + " ranks; A: alignment, 1 .. " +
         log2(rfsdp::kMaxAlignBytes) + " bytes (default " + std::to_string(rfsdp::kDefaultAlignBytes) +
         ");\n"
         "  K: at most this many buffers (collectives) per unit, 1 .. " +
         std::to_string(rfsdp::kMaxBuffers) + " (default " + std::to_string(defaults.max_buffers) +
         "; 1: one buffer);\n"
         "  C: a collective's fixed cost as bytes received (latency x bandwidth; default " +
         std::to_string(defaults.collective_cost_bytes) + "),\n"
         "     0 .. " + log2(rfsdp::kMaxCollectiveCostBytes) +
         ". A unit must keep M x its elements x dtype_bytes within " + log2(rfsdp::kMaxGatherBytes) +
         " bytes.\n"
         "  --report: a training step of L such units (default 1) at M GPUs, rfsdp beside FSDP2:\n"
         "        bytes per rank under each communication policy, FSDP2's copies, a modelled\n"
         "        time from the links (defaults: H200 nodes of 8, NVLink 450 GB/s a GPU,\n"
         "        400 Gb/s NICs); its assumptions are printed with it.\n";
}

int64_t parse_int(const std::string& flag, const char* text) {
  if (text == nullptr) throw std::invalid_argument(flag + " needs a value");
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0') {
    throw std::invalid_argument(flag + " takes an integer, got '" + text + "'");
  }
  if (errno == ERANGE) {  // strtoll clamped it
    throw std::invalid_argument(flag + " takes a 64-bit integer (at most 2^63 - 1), got '" +
                                text + "'");
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

// The wire formats the tables compare: the plan's elements, bf16, block codes
// (1-byte codes and an fp32 scale a block of B: the plan must keep them whole);
// gradients in fp32 or bf16.
struct WireRow {
  std::string name;
  rfsdp::WireFormat wire;
};
std::vector<WireRow> wire_rows(const rfsdp::Plan& plan, int64_t block) {
  std::vector<WireRow> rows;
  for (int64_t g : {4, 2}) {
    const std::string grads = g == 4 ? " / fp32" : " / bf16";
    if (plan.elem_bytes != 2) {
      rows.push_back({"elements of " + std::to_string(plan.elem_bytes) + " bytes" + grads,
                      {plan.elem_bytes, 0, g, g == 4 ? 4 : g}});
    }
    rows.push_back({"bfloat16" + grads, {2, 0, g, g == 4 ? 4 : g}});
    rows.push_back({"int8 / float8 codes, blocks of " + std::to_string(block) + grads,
                    {1, block, g, g == 4 ? 4 : g}});
  }
  return rows;
}

// What one training step sends from each rank (a gather for forward, one for
// backward, a reduce-scatter: core/ragged/step_model.h) under each policy.
void print_comm_table(const rfsdp::Plan& plan, int64_t block) {
  const bool whole = !rfsdp::first_block_cut(plan, block).has_value();
  const double mib = 1.0 / (1 << 20);
  std::printf("\nbytes sent per rank per step (2 all-gathers + 1 reduce-scatter), by communication policy:\n");
  std::printf("%-40s %14s %14s %14s\n", "weights / gradients", "gathers MiB", "reduce MiB", "total MiB");
  for (const WireRow& r : wire_rows(plan, block)) {
    if (r.wire.code_block > 0 && !whole) {
      std::printf("%-40s %14s (the plan cuts blocks of %lld: plan with that granule)\n",
                  r.name.c_str(), "n/a", static_cast<long long>(block));
      continue;
    }
    const double gathers = 2.0 * rfsdp::gather_bytes(plan, r.wire) * mib;
    const double reduce = rfsdp::reduce_bytes(plan, r.wire) * mib;
    std::printf("%-40s %14.3f %14.3f %14.3f\n", r.name.c_str(), gathers, reduce, gathers + reduce);
  }
}

// A step of `layers` units at the plan's world size, rfsdp beside FSDP2, modelled.
void print_report(const rfsdp::Plan& plan, int64_t block, int64_t layers,
                  const rfsdp::LinkModel& links) {
  const int64_t m = plan.world_size;
  const double mib = 1.0 / (1 << 20), ms = 1e3;
  const rfsdp::Fsdp2Unit f2 = rfsdp::fsdp2_unit(plan.tensors, m);
  std::printf("\nstep report: %lld unit(s) like this one at %lld GPUs\n", static_cast<long long>(layers),
              static_cast<long long>(m));
  std::printf("model: %s. Each collective is a ring over the %lld ranks: the bytes a rank sends "
              "(its slice to each of the m - 1 others) at the slowest link it crosses, plus one "
              "latency per step (m - 1 steps); per unit and step two all-gathers and one "
              "reduce-scatter; FSDP2 adds its copies (all-gather copy-in of the shard and copy-out "
              "of the unit into the parameters, twice; the gradients' copy-in before the "
              "reduce-scatter) at the HBM bandwidth. Communication alone: compute, overlap and "
              "the optimizer are not modelled.\n",
              links.describe().c_str(), static_cast<long long>(m));
  std::printf("padding: rfsdp %.3f %% (S = %lld), FSDP2 Shard(0) %.3f %% (S = %lld)\n",
              100.0 * plan.padding_fraction(), static_cast<long long>(plan.shard_elems),
              100.0 * (1.0 - static_cast<double>(f2.total_elems) / (m * f2.shard_elems)),
              static_cast<long long>(f2.shard_elems));
  std::printf("%-46s %12s %12s %12s %12s\n", "layout: weights / gradients", "sent MiB",
              "copied MiB", "comm ms", "step ms");
  const bool whole = !rfsdp::first_block_cut(plan, block).has_value();
  auto row = [&](const std::string& name, int64_t gather, int64_t reduce, int64_t copied) {
    const double t = 2 * rfsdp::collective_seconds(gather, m, links) +
                     rfsdp::collective_seconds(reduce, m, links);
    const double total = t + rfsdp::copy_seconds(copied, links);
    std::printf("%-46s %12.1f %12.1f %12.2f %12.2f\n", name.c_str(),
                layers * (2.0 * gather + reduce) * mib, layers * copied * mib, layers * t * ms,
                layers * total * ms);
  };
  for (const WireRow& r : wire_rows(plan, block)) {
    if (r.wire.code_block > 0 && !whole) continue;
    row("rfsdp: " + r.name, rfsdp::gather_bytes(plan, r.wire), rfsdp::reduce_bytes(plan, r.wire), 0);
  }
  // FSDP2: bf16 all-gather, fp32 (or bf16) reduce-scatter of its padded chunks.
  rfsdp::Plan fsdp2 = plan;
  fsdp2.shard_elems = f2.shard_elems;
  fsdp2.buffer_shard_elems.clear();
  for (int64_t g : {4, 2}) {
    const rfsdp::WireFormat w{2, 0, g, g};
    const int64_t copied = rfsdp::fsdp2_copy_bytes(f2, m, 2, g);
    row(std::string("FSDP2: bfloat16 / ") + (g == 4 ? "fp32" : "bf16"),
        rfsdp::gather_bytes(fsdp2, w), rfsdp::reduce_bytes(fsdp2, w), copied);
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::string path;
    int64_t world_size = 0, align_bytes = rfsdp::kDefaultAlignBytes;
    bool have_world_size = false;
    bool as_json = false;
    int64_t weight_block = 256;  // the weights' code blocks in the bytes table
    bool report = false;
    int64_t layers = 1;
    rfsdp::LinkModel links;
    auto parse_double = [&](const std::string& flag, const char* text) {
      if (text == nullptr) throw std::invalid_argument(flag + " needs a value");
      char* end = nullptr;
      const double v = std::strtod(text, &end);
      if (end == text || *end != '\0' || !(v > 0)) {
        throw std::invalid_argument(flag + " takes a positive number, got '" + text + "'");
      }
      return v;
    };
    rfsdp::PlannerOptions options;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--world-size") {
        world_size = parse_int(a, i + 1 < argc ? argv[++i] : nullptr);
        have_world_size = true;
      } else if (a == "--align-bytes") {  // (this and the next two: plan_unit checks the limits)
        align_bytes = parse_int(a, i + 1 < argc ? argv[++i] : nullptr);
      } else if (a == "--max-buffers") {
        options.max_buffers = parse_int(a, i + 1 < argc ? argv[++i] : nullptr);
      } else if (a == "--collective-cost-bytes") {
        options.collective_cost_bytes = parse_int(a, i + 1 < argc ? argv[++i] : nullptr);
      } else if (a == "--weight-block") {
        weight_block = parse_int(a, i + 1 < argc ? argv[++i] : nullptr);
        if (weight_block < 1) throw std::invalid_argument("--weight-block must be positive");
      } else if (a == "--report") {
        report = true;
      } else if (a == "--layers") {
        layers = parse_int(a, i + 1 < argc ? argv[++i] : nullptr);
        if (layers < 1) throw std::invalid_argument("--layers must be >= 1");
      } else if (a == "--node-size") {
        links.node_size = parse_int(a, i + 1 < argc ? argv[++i] : nullptr);
        if (links.node_size < 1) throw std::invalid_argument("--node-size must be >= 1");
      } else if (a == "--intra-gbps") {
        links.intra_gbps = parse_double(a, i + 1 < argc ? argv[++i] : nullptr);
      } else if (a == "--inter-gbps") {
        links.inter_gbps = parse_double(a, i + 1 < argc ? argv[++i] : nullptr);
      } else if (a == "--intra-latency-us") {
        links.intra_latency_us = parse_double(a, i + 1 < argc ? argv[++i] : nullptr);
      } else if (a == "--inter-latency-us") {
        links.inter_latency_us = parse_double(a, i + 1 < argc ? argv[++i] : nullptr);
      } else if (a == "--hbm-gbps") {
        links.hbm_gbps = parse_double(a, i + 1 < argc ? argv[++i] : nullptr);
      } else if (a == "--json") {
        as_json = true;
      } else if (a == "--version") {
        std::cout << "rfsdp-plan (RaggedFSDP) " << RFSDP_VERSION << "\n";
        return 0;
      } else if (a == "-h" || a == "--help") {
        std::cout << usage();
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
      if (report) print_report(plan, weight_block, layers, links);
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "rfsdp-plan: error: " << e.what() << "\n";
    return 2;
  }
}
