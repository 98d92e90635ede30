// bench_planner: the RaggedShard planner over the model zoo, beside the two
// formats the veScale-FSDP paper compares against, from the same shapes:
//   flat  - element-wise flat sharding (FSDP1 / DeepSpeed ZeRO-3): the unit's
//           tensors concatenated, cut into m equal pieces;
//   fsdp2 - FSDP2's Shard(0): every tensor cut along dim 0 into m chunks of
//           ceil(dim0 / m) rows, padded.
// For each: padding (% of the sharded buffer) and how many granules (the
// blocks an optimizer or quantiser needs whole) are cut across ranks.
//
// --blocks: the pad-to-block comparison. For each unit of the zoo and each whole
// model (its units times their layer counts), per block kind (MXFP8's 32-element
// blocks, 8-bit 256-element blocks, 32x32 tiles, Shampoo's 1024-row tiles, per-head
// Muon) and world size: (a) rfsdp's planner; (b) every tensor's shard padded up to
// whole blocks (ceil(rows / m) rounded up to the granule: Megatron-LM's "pad more
// aggressively", and what FSDP2's chunks need to hold whole blocks); (c) FSDP2's
// Shard(0) chunks as they are (padding, and how many blocks they cut). Padding and
// MiB per rank (bf16) for each; the planner's time beside (a).
//
// --roots: Muon at scale on the ragged plan (granule 1), from the layout rank 0
// computes (MuonLayout::planned): per block unit and m, the matrices (or heads:
// q/k/v split per head) held whole on one rank, Newton-Schulz flops rooted on the
// busiest rank over the mean (LPT), and the fp32 update elements a rank sends and
// receives in the gather to the roots and the scatter back (max and mean).
//
// --tiles: Shampoo's / SOAP's preconditioner work per rank at scale (1024-row
// tiles, eigendecomposition cost rows^3 + cols^3 a tile): tiles whole on one rank
// (the tile granule), the ragged plan (granule 1: cut tile rows to their owners)
// and FSDP2's chunk rows; busiest rank over the mean, and the cut rows' elements
// a rank sends and receives (max).
// --tp DPxTP: Muon's owner-exchange traffic per step for each zoo block on a
// (dp, tp) mesh (flat rank d * tp + t, as torch's DeviceMesh numbers it), on paper
// from the layout rank 0 computes (MuonLayout::planned), for three layouts of the
// block's matrices:
//   fsdp      - no tensor parallelism: the block planned over dp * tp ranks
//               (the ragged plan, granule 1), so matrices and heads are cut
//               wherever the plan cuts them, across tp ranks too;
//   tp+fsdp2  - torch's ColwiseParallel (rows) of q/k/v/gate/up and
//               RowwiseParallel (column parts) of o/down over tp, each tp piece
//               cut over dp by FSDP2's Shard(0) chunks: every tp rank holds whole
//               heads, dp cuts them;
//   tp+ragged - the same tp pieces planned over dp by rfsdp's planner, a head's
//               rows the granule of q/k/v (1 for the rest).
// and two Muon groupings: each matrix one block ("whole"), or q/k/v split per
// head (split_sizes; "heads"). Formula: a block u of N_u elements with root o(u)
// and n(u, r) of its elements on rank r; the gather sends every n(u, r), r != o(u),
// to the root, the scatter sends them back, 4 bytes each way (the fp32 update):
//   sent by rank r = 4 * (sum over u with o(u) != r of n(u, r)
//                         + sum over u with o(u) == r of (N_u - n(u, r))),
//   total = sum over r = 8 * sum over u of (N_u - n(u, o(u))),
// and the part of it between ranks of different tp index (r mod tp != o(u) mod tp).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <dirent.h>
#include <fstream>
#include <map>
#include <optional>
#include <tuple>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/ragged/int_math.h"
#include "core/ragged/plan_json.h"
#include "core/ragged/planner.h"
#include "core/ragged/step_model.h"
#include "optimizers/common/tiles.h"
#include "optimizers/muon/layout.h"
#include "quant/ops.h"

namespace {

using rfsdp::TensorSpec;

struct Mode {
  std::string label;
  int64_t rows;  // 0: each Muon matrix whole
};

// "whole" as Muon ownership asks: 2-D matrices whole, a fused expert stack
// [E, H, I] (row_dims 2) in granules of one expert's H rows, vectors free.
std::vector<TensorSpec> with_granules(std::vector<TensorSpec> unit, const Mode& mode) {
  for (auto& t : unit) {
    if (mode.rows > 0) {
      t.granule_rows = mode.rows;
    } else if (t.shape.size() >= 2) {
      t.granule_rows = t.row_dims == 2 ? t.shape[1] : rfsdp::kWholeTensor;
    } else {
      t.granule_rows = 1;
    }
  }
  return unit;
}

// Distinct granules of a tensor that contain a cut at one of `cuts` (tensor-local
// element positions, ascending).
int64_t granules_cut(const TensorSpec& t, const std::vector<int64_t>& cuts) {
  const int64_t G = t.granule_elems(), n = t.numel();
  int64_t count = 0, last = -1;
  for (int64_t c : cuts) {
    if (c <= 0 || c >= n || c % G == 0) continue;
    if (c / G != last) ++count, last = c / G;
  }
  return count;
}

struct Baseline {
  double padding = 0;
  int64_t cut = 0;
};

Baseline flat_sharding(const std::vector<TensorSpec>& unit, int64_t m, int64_t align) {
  int64_t total = 0;
  for (const auto& t : unit) total += t.numel();
  const int64_t S = rfsdp::round_up(rfsdp::ceil_div(total, m), align);
  Baseline b;
  b.padding = 1.0 - static_cast<double>(total) / static_cast<double>(m * S);
  int64_t off = 0;
  std::vector<int64_t> cuts;
  for (const auto& t : unit) {
    cuts.clear();
    for (int64_t k = off / S + 1; k * S < off + t.numel(); ++k) cuts.push_back(k * S - off);
    b.cut += granules_cut(t, cuts);
    off += t.numel();
  }
  return b;
}

// Granules that FSDP2's Shard(0) chunks (ceil(dim0 / m) rows of dim 0) cut.
int64_t fsdp2_cut(const std::vector<TensorSpec>& unit, int64_t m) {
  int64_t cut = 0;
  std::vector<int64_t> cuts;
  for (const auto& t : unit) {
    const int64_t dim0 = t.shape.empty() ? 1 : t.shape[0];
    const int64_t row0 = t.numel() / dim0;
    const int64_t chunk = rfsdp::ceil_div(dim0, m);
    cuts.clear();
    for (int64_t i = 1; i < m && i * chunk < dim0; ++i) cuts.push_back(i * chunk * row0);
    cut += granules_cut(t, cuts);
  }
  return cut;
}

Baseline fsdp2_shard0(const std::vector<TensorSpec>& unit, int64_t m) {
  const rfsdp::Fsdp2Unit f2 = rfsdp::fsdp2_unit(unit, m);  // (core/ragged/step_model.h)
  Baseline b;
  b.padding = 1.0 - static_cast<double>(f2.total_elems) / static_cast<double>(m * f2.shard_elems);
  b.cut = fsdp2_cut(unit, m);
  return b;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<std::string> zoo_files(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = opendir(dir.c_str());
  if (!d) throw std::runtime_error("cannot open zoo folder " + dir);
  while (dirent* e = readdir(d)) {
    const std::string n = e->d_name;
    if (n.size() > 5 && n.substr(n.size() - 5) == ".json") names.push_back(n);
  }
  closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

// The zoo's transformer-block units (names holding "block", and `only` where
// given) with their matrices (the tensors of 2 or more dims), in file order.
std::vector<std::pair<std::string, std::vector<TensorSpec>>> zoo_block_matrices(const std::string& zoo,
                                                                                const std::string& only) {
  std::vector<std::pair<std::string, std::vector<TensorSpec>>> out;
  for (const auto& file : zoo_files(zoo)) {
    const std::string unit_name = file.substr(0, file.size() - 5);
    if (unit_name.find("block") == std::string::npos) continue;
    if (!only.empty() && unit_name.find(only) == std::string::npos) continue;
    std::vector<TensorSpec> mats;
    for (auto t : rfsdp::unit_from_json(read_file(zoo + "/" + file))) {
      if (t.shape.size() >= 2) mats.push_back(t);
    }
    out.emplace_back(unit_name, std::move(mats));
  }
  return out;
}

// ---- --blocks: the pad-to-block comparison ----------------------------------

// The block kinds, as the rows each tensor's shard must hold whole.
enum class Kind { kMxfp8, kQuant256, kTiles32, kShampoo1024, kMuonHeads };
const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kMxfp8: return "mxfp8-32";
    case Kind::kQuant256: return "8bit-256";
    case Kind::kTiles32: return "tile-32x32";
    case Kind::kShampoo1024: return "shampoo-1024";
    case Kind::kMuonHeads: return "muon-heads";
  }
  return "?";
}

bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

// Rows of one attention head in a projection whose rows are heads (q, k, v; MLA's
// q_b and kv_b), 0 for other tensors; by model (the zoo's configs).
int64_t head_rows(const std::string& unit, const std::string& name) {
  if (contains(unit, "deepseek_v3")) {
    if (contains(name, "q_b_proj")) return 192;   // nope 128 + rope 64 per head
    if (contains(name, "kv_b_proj")) return 256;  // nope 128 + v 128 per head
    return 0;
  }
  if (!(contains(name, "q_proj") || contains(name, "k_proj") || contains(name, "v_proj"))) return 0;
  return contains(unit, "gpt_oss") ? 64 : 128;
}

std::vector<TensorSpec> with_kind(std::vector<TensorSpec> unit, Kind kind, const std::string& unit_name) {
  for (auto& t : unit) {
    const bool matrix = t.shape.size() >= 2;
    const int64_t row = t.row_elems();
    switch (kind) {
      case Kind::kMxfp8:  // 1x32 and 32x1 scaling blocks (both GEMM directions): 32 rows
        t.granule_rows = matrix ? 32 : 1;
        break;
      case Kind::kQuant256:  // 8-bit optimizer states, every tensor
        t.granule_rows = rfsdp::quant::BlockShape::blocks(256).granule_rows(row);
        break;
      case Kind::kTiles32:
        t.granule_rows = matrix ? 32 : 1;
        break;
      case Kind::kShampoo1024:
        t.granule_rows = rfsdp::tile_granule_rows(t.shape, t.row_dims, 1024);
        break;
      case Kind::kMuonHeads: {  // heads where the rows are heads, else whole matrices
        const int64_t h = head_rows(unit_name, t.name);
        if (h > 0 && t.rows() % h == 0) t.granule_rows = h;
        else if (!matrix) t.granule_rows = 1;
        else t.granule_rows = t.row_dims == 2 ? t.shape[1] : rfsdp::kWholeTensor;
        break;
      }
    }
    if (t.granule_rows != rfsdp::kWholeTensor && t.granule_rows >= t.rows()) t.granule_rows = rfsdp::kWholeTensor;
  }
  return unit;
}

// Elements per rank and elements in all when every tensor's shard is its own
// ceil(rows / m) rows rounded up to whole granules (a whole tensor on one rank).
struct PerRank {
  int64_t per_rank = 0, total = 0;
};
PerRank pad_each_tensor(const std::vector<TensorSpec>& unit, int64_t m) {
  PerRank r;
  for (const auto& t : unit) {
    const int64_t g = t.granule_rows == rfsdp::kWholeTensor ? t.rows() : t.granule_rows;
    const int64_t rows = rfsdp::round_up(rfsdp::ceil_div(t.rows(), m), g);
    r.per_rank += std::min(rows, rfsdp::round_up(t.rows(), g)) * t.row_elems();
    r.total += t.numel();
  }
  return r;
}

// Layer counts of the zoo's models: unit name -> how many of it the model has.
const std::vector<std::pair<std::string, std::vector<std::pair<std::string, int>>>> kModels = {
    {"llama3_8b", {{"llama3_8b.block", 32}, {"llama3_8b.embed_head", 1}}},
    {"llama3_70b", {{"llama3_70b.block", 80}, {"llama3_70b.embed_head", 1}}},
    {"gpt_oss_120b", {{"gpt_oss_120b.block", 36}, {"gpt_oss_120b.embed_head", 1}}},
    {"deepseek_v3", {{"deepseek_v3.dense_block", 3}, {"deepseek_v3.moe_block", 58},
                     {"deepseek_v3.embed_head", 1}}},
    {"qwen3_30b_a3b", {{"qwen3_30b_a3b.block", 48}, {"qwen3_30b_a3b.embed_head", 1}}},
    {"mixtral_8x22b", {{"mixtral_8x22b.block", 56}, {"mixtral_8x22b.embed_head", 1}}},
};

// `layers` copies of a unit's tensors in one unit (a wider plan: several layers a unit).
std::vector<TensorSpec> layers_of(const std::vector<TensorSpec>& unit, int layers) {
  std::vector<TensorSpec> out;
  for (int l = 0; l < layers; ++l) {
    for (TensorSpec t : unit) {
      t.name = "layer" + std::to_string(l) + "." + t.name;
      out.push_back(std::move(t));
    }
  }
  return out;
}
constexpr int kWideLayers = 8;

struct Row {  // one unit (or model), kind and m
  double elems = 0, rf = 0, each = 0, f2 = 0;  // elements; per-rank elements of (a), (b), (c)
  double wide = 0;  // per-rank elements of (a) over kWideLayers layers a unit, per layer
  double plan_ms = 0;
  int64_t f2_cut = 0;
  bool granule_over_shard = false;  // some granule holds more than an even share
};

int pad_to_block(const std::string& zoo, const std::string& only, const std::vector<int64_t>& ms) {
  const std::vector<Kind> kinds = {Kind::kMxfp8, Kind::kQuant256, Kind::kTiles32,
                                   Kind::kShampoo1024, Kind::kMuonHeads};
  std::printf("Pad-to-block: padding %% of the sharded buffer and MiB per rank (bf16) for (a) rfsdp's "
              "planner (plan ms beside it), (b) every tensor's shard padded to whole blocks "
              "(Megatron's option; FSDP2 made whole), (c) FSDP2 Shard(0) as is (and the blocks it "
              "cuts). (a) 8 lay: rfsdp with 8 layers in one unit (a wider plan). '*': rfsdp pads > 3 %% where a granule holds more than an even share of the "
              "unit (structural: a block bigger than a shard).\n"
              "Blocks: mxfp8-32 = 1x32 and 32x1 scaling blocks of every matrix (32 rows); 8bit-256 = "
              "256-element blocks of every tensor; tile-32x32 = 32 rows of every matrix; "
              "shampoo-1024 = 1024-row tiles (an expert's rows when not a multiple); muon-heads = "
              "one head's rows of q/k/v (MLA: q_b, kv_b), other matrices whole, a fused expert "
              "stack one expert.\n\n");
  std::printf("%-26s %-12s %6s | %7s %9s %7s | %8s | %7s %9s | %7s %9s %8s\n", "unit / model", "blocks", "m",
              "(a) pad", "MiB/rank", "plan ms", "(a) 8 lay", "(b) pad", "MiB/rank", "(c) pad",
              "MiB/rank", "cut");
  std::map<std::tuple<std::string, int, int64_t>, Row> rows;  // (unit, kind, m)
  auto print = [](const std::string& name, Kind k, int64_t m, const Row& r) {
    auto pad = [&](double per) { return 100.0 * (1.0 - r.elems / (m * per)); };
    const double mib = 2.0 / (1 << 20);
    std::printf("%-26s %-12s %6lld | %6.3f%s %9.1f %7.2f | %8.3f | %7.3f %9.1f | %7.3f %9.1f %8lld\n",
                name.c_str(), kind_name(k), static_cast<long long>(m), pad(r.rf),
                pad(r.rf) > 3.0 && r.granule_over_shard ? "*" : " ", r.rf * mib, r.plan_ms,
                pad(r.wide), pad(r.each), r.each * mib, pad(r.f2), r.f2 * mib,
                static_cast<long long>(r.f2_cut));
  };
  for (const auto& file : zoo_files(zoo)) {
    const std::string unit_name = file.substr(0, file.size() - 5);
    const auto unit = rfsdp::unit_from_json(read_file(zoo + "/" + file));
    for (size_t k = 0; k < kinds.size(); ++k) {
      const auto specs = with_kind(unit, kinds[k], unit_name);
      for (int64_t m : ms) {
        const rfsdp::Plan plan = rfsdp::plan_unit(specs, m, 16);
        rfsdp::validate_plan(plan);
        Row r;
        const PerRank each = pad_each_tensor(specs, m);
        const rfsdp::Fsdp2Unit f2 = rfsdp::fsdp2_unit(specs, m);
        r.elems = static_cast<double>(each.total);
        r.rf = static_cast<double>(plan.shard_elems);
        r.each = static_cast<double>(each.per_rank);
        r.f2 = static_cast<double>(f2.shard_elems);
        r.f2_cut = fsdp2_cut(specs, m);
        r.plan_ms = plan.plan_seconds * 1e3;
        if (unit_name.find("block") != std::string::npos) {
          r.wide = static_cast<double>(rfsdp::plan_unit(layers_of(specs, kWideLayers), m, 16).shard_elems) /
                   kWideLayers;
        } else {
          r.wide = r.rf;  // (one per model)
        }
        for (const auto& t : specs) {
          if (t.granule_elems() > rfsdp::ceil_div(each.total, m)) r.granule_over_shard = true;
        }
        rows[{unit_name, static_cast<int>(k), m}] = r;
        if (only.empty() || unit_name.find(only) != std::string::npos) print(unit_name, kinds[k], m, r);
      }
    }
  }
  std::printf("\nWhole models (each unit times its layer count):\n");
  for (const auto& [model, units] : kModels) {
    if (!only.empty() && model.find(only) == std::string::npos) continue;
    for (size_t k = 0; k < kinds.size(); ++k) {
      for (int64_t m : ms) {
        Row sum;
        bool complete = true;
        for (const auto& [unit, count] : units) {
          const auto it = rows.find({unit, static_cast<int>(k), m});
          if (it == rows.end()) { complete = false; break; }
          const Row& r = it->second;
          sum.elems += count * r.elems, sum.rf += count * r.rf, sum.each += count * r.each;
          sum.wide += count * r.wide;
          sum.f2 += count * r.f2, sum.f2_cut += count * r.f2_cut, sum.plan_ms += r.plan_ms;
          sum.granule_over_shard = sum.granule_over_shard || r.granule_over_shard;
        }
        if (complete) print(model, kinds[k], m, sum);
      }
    }
  }
  return 0;
}

struct RootStats {
  size_t blocks = 0;
  int64_t whole = 0;
  double imbalance = 0, max_elems = 0, mean_elems = 0;
};

// Muon's layout over these shards at m ranks (rank 0's view), summarised.
RootStats root_stats(const std::vector<rfsdp::TensorShard>& shards,
                     const std::vector<std::vector<int64_t>>& split, int64_t m) {
  const rfsdp::MuonLayout layout = rfsdp::MuonLayout::planned(
      static_cast<int>(m), shards, std::vector<int>(shards.size(), 5), split);
  const rfsdp::OwnerExchange& x = layout.exchange();
  std::vector<double> moved(m, 0.0);
  RootStats st;
  st.blocks = x.size();
  for (size_t u = 0; u < x.size(); ++u) {
    const int owner = x.units()[u].owner;
    bool one = false;
    for (int r = 0; r < m; ++r) {
      const auto [b, e] = x.piece(u, r);
      const int64_t n = e - b;
      if (n == x.units()[u].numel()) one = true;
      if (r == owner || n == 0) continue;
      moved[r] += 2.0 * n;      // its piece out (gather) and its result back (scatter)
      moved[owner] += 2.0 * n;  // and the root's side of both
    }
    st.whole += one;
  }
  st.imbalance = layout.flop_imbalance();
  st.max_elems = *std::max_element(moved.begin(), moved.end());
  for (double v : moved) st.mean_elems += v / m;
  return st;
}

int muon_roots(const std::string& zoo, const std::string& only, const std::vector<int64_t>& ms) {
  std::printf("Muon roots on the ragged plan (granule 1): blocks = matrices (whole) or heads (q/k/v "
              "split per head, MLA's q_b/kv_b too); whole = held by one rank (nothing moves); "
              "flops max/mean = Newton-Schulz flops on the busiest root over the mean (LPT); MiB = fp32 "
              "update a rank sends + receives per step (gather to the roots and scatter back), max "
              "and mean over ranks. 'model': every layer's unit (each planned alone, as FSDP units "
              "are) in one optimizer, its roots balanced together.\n\n");
  std::printf("%-26s %-6s %-7s %6s | %7s %7s | %10s | %10s %10s | %8s\n", "unit", "scope", "blocks", "m",
              "blocks", "whole", "flops max/mean", "MiB max", "MiB mean", "ms");
  for (const auto& file : zoo_files(zoo)) {
    const std::string unit_name = file.substr(0, file.size() - 5);
    if (unit_name.find("block") == std::string::npos) continue;
    if (!only.empty() && unit_name.find(only) == std::string::npos) continue;
    int layers = 1;
    for (const auto& [model, units] : kModels) {
      for (const auto& [u, count] : units) {
        if (u == unit_name) layers = count;
      }
    }
    std::vector<TensorSpec> mats;
    for (auto t : rfsdp::unit_from_json(read_file(zoo + "/" + file))) {
      if (t.shape.size() >= 2) t.granule_rows = 1, mats.push_back(t);
    }
    for (bool heads : {false, true}) {
      for (int64_t m : ms) {
        const rfsdp::Plan plan = rfsdp::plan_unit(mats, m, 16);
        std::vector<rfsdp::TensorShard> shards, model;
        std::vector<std::vector<int64_t>> split, model_split;
        for (size_t i = 0; i < plan.tensors.size(); ++i) {
          shards.push_back(rfsdp::TensorShard::of_plan(plan, i, 0));
          const TensorSpec& t = plan.tensors[i];
          const int64_t h = heads && t.shape.size() == 2 ? head_rows(unit_name, t.name) : 0;
          split.push_back(h > 0 && t.shape[0] % h == 0 ? std::vector<int64_t>(t.shape[0] / h, h)
                                                       : std::vector<int64_t>{});
        }
        for (int l = 0; l < layers; ++l) {
          for (size_t i = 0; i < shards.size(); ++i) {
            rfsdp::TensorShard s = shards[i];
            s.name = "layer" + std::to_string(l) + "." + s.name;
            model.push_back(std::move(s));
            model_split.push_back(split[i]);
          }
        }
        for (int scope = 0; scope < (layers > 1 ? 2 : 1); ++scope) {
          const auto t0 = std::chrono::steady_clock::now();
          const RootStats st = scope ? root_stats(model, model_split, m) : root_stats(shards, split, m);
          const double ms_taken =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e3;
          const double mib = 4.0 / (1 << 20);
          std::printf("%-26s %-6s %-7s %6lld | %7zu %7lld | %10.3f | %10.1f %10.1f | %8.1f\n",
                      unit_name.c_str(), scope ? ("x" + std::to_string(layers)).c_str() : "unit",
                      heads ? "heads" : "whole", static_cast<long long>(m), st.blocks,
                      static_cast<long long>(st.whole), st.imbalance, st.max_elems * mib,
                      st.mean_elems * mib, ms_taken);
        }
      }
    }
  }
  return 0;
}

int shampoo_tiles(const std::string& zoo, const std::string& only, const std::vector<int64_t>& ms) {
  constexpr int64_t kDim = 1024;
  std::printf("Shampoo/SOAP tiles of at most %lld x %lld, cost rows^3 + cols^3 a tile (its factors' "
              "eigendecompositions): layout = tiles whole (the tile granule), ragged (granule 1; cut "
              "tile rows to the rank holding their first row), fsdp2 (chunk rows, cut rows likewise); "
              "cost max/mean over ranks (1 = balanced), ranks with no tile, cut rows, and the cut rows' "
              "elements a rank sends + receives per step (max; fp32 moments and update: x3 fields).\n\n",
              static_cast<long long>(kDim), static_cast<long long>(kDim));
  std::printf("%-26s %-6s %6s | %7s %10s %8s | %8s %10s | %8s\n", "unit", "layout", "m", "tiles",
              "cost max/mean", "idle", "cut rows", "MiB max", "ms");
  for (const auto& [unit_name, mats] : zoo_block_matrices(zoo, only)) {
    for (const char* layout : {"whole", "ragged", "fsdp2"}) {
      for (int64_t m : ms) {
        const auto t0 = std::chrono::steady_clock::now();
        std::vector<TensorSpec> specs = mats;
        for (auto& t : specs) {
          t.granule_rows = std::string(layout) == "whole" ? rfsdp::tile_granule_rows(t.shape, t.row_dims, kDim) : 1;
          if (t.granule_rows >= t.rows()) t.granule_rows = rfsdp::kWholeTensor;
        }
        const rfsdp::Plan plan = rfsdp::plan_unit(specs, m, 16);
        std::vector<double> cost(m, 0.0), moved(m, 0.0);
        int64_t tiles = 0, cut_rows = 0;
        for (size_t i = 0; i < specs.size(); ++i) {
          const TensorSpec& t = specs[i];
          std::vector<std::pair<int64_t, int64_t>> rows;  // every rank's rows
          if (std::string(layout) == "fsdp2") {  // torch.chunk over dim 0 (row_dims 1 here)
            const int64_t chunk = rfsdp::ceil_div(t.rows(), m);
            for (int64_t r = 0; r < m; ++r) rows.push_back({std::min(r * chunk, t.rows()), std::min((r + 1) * chunk, t.rows())});
          } else {
            for (int64_t r = 0; r < m; ++r) {
              const rfsdp::ShardRange sr = plan.shard(i, r);
              rows.push_back({sr.row_begin, sr.row_end});
            }
          }
          for (int64_t r = 0; r < m; ++r) {
            const rfsdp::TensorShard shard =
                rfsdp::TensorShard::rows_of(t.name, t.shape, t.row_dims, rows[r].first, rows[r].second, rows);
            std::vector<rfsdp::CutTileRow> cut;
            for (const rfsdp::Tile& tl : rfsdp::matrix_tiles("Shampoo", shard, i, kDim, static_cast<int>(r), &cut)) {
              cost[r] += std::pow(static_cast<double>(tl.rows), 3) + std::pow(static_cast<double>(tl.cols), 3);
              ++tiles;
            }
            if (r == 0) {  // (every rank lists every cut row: count them once, and their traffic)
              cut_rows += static_cast<int64_t>(cut.size());
              for (const rfsdp::CutTileRow& c : cut) {
                for (int64_t q = 0; q < m; ++q) {  // each holder's part to the owner and back
                  const int64_t b = std::max(c.begin, rows[q].first * t.row_elems());
                  const int64_t e = std::min(c.end, rows[q].second * t.row_elems());
                  if (e <= b || q == c.owner) continue;
                  moved[q] += 2.0 * (e - b);
                  moved[c.owner] += 2.0 * (e - b);
                }
              }
            }
          }
        }
        double mean = 0, mx = 0;
        int64_t idle = 0;
        for (double c : cost) mean += c / m, mx = std::max(mx, c), idle += c == 0;
        const double moved_max = *std::max_element(moved.begin(), moved.end());
        const double ms_taken = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e3;
        std::printf("%-26s %-6s %6lld | %7lld %10.3f %8lld | %8lld %10.1f | %8.1f\n", unit_name.c_str(),
                    layout, static_cast<long long>(m), static_cast<long long>(tiles),
                    mean > 0 ? mx / mean : 0.0, static_cast<long long>(idle),
                    static_cast<long long>(cut_rows), 3 * 4.0 * moved_max / (1 << 20), ms_taken);
      }
    }
  }
  return 0;
}

// ---- --tp: Muon's traffic on a (dp, tp) mesh ----------------------------------

// torchtitan's plan for a Llama block: q/k/v/gate/up ColwiseParallel (true),
// o/down RowwiseParallel (false); another matrix has no plan here (an error).
bool colwise(const std::string& name) {
  for (const char* n : {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}) {
    if (contains(name, n)) return true;
  }
  for (const char* n : {"o_proj", "down_proj"}) {
    if (contains(name, n)) return false;
  }
  throw std::runtime_error("no tensor-parallel plan here for " + name + " (Llama's projections only)");
}

// The block's matrices over dp * tp ranks in one of --tp's layouts: each one's
// TensorShard (rank 0's, with every rank's rows).
std::vector<rfsdp::TensorShard> tp_layout(const std::string& unit, const std::vector<TensorSpec>& mats,
                                          const std::string& layout, int64_t dp, int64_t tp) {
  const int64_t world = dp * tp;
  std::vector<rfsdp::TensorShard> out;
  if (layout == "fsdp") {
    const rfsdp::Plan plan = rfsdp::plan_unit(mats, world, 16);
    for (size_t i = 0; i < plan.tensors.size(); ++i) out.push_back(rfsdp::TensorShard::of_plan(plan, i, 0));
    return out;
  }
  // Each tp rank's piece: rows [t R / tp, (t + 1) R / tp) (Colwise), or column part t (Rowwise).
  std::vector<TensorSpec> local = mats;
  for (auto& t : local) {
    const size_t dim = colwise(t.name) ? 0 : 1;
    if (t.shape.size() != 2 || t.shape[dim] % tp != 0) {
      throw std::runtime_error("--tp: " + t.name + " is not a matrix whose " +
                               (dim ? "columns" : "rows") + " tp divides");
    }
    t.shape[dim] /= tp;
    t.granule_rows = 1;
    if (layout == "tp+ragged" && dim == 0) {
      const int64_t h = head_rows(unit, t.name);
      if (h > 0 && t.shape[0] % h == 0) t.granule_rows = h < t.shape[0] ? h : rfsdp::kWholeTensor;
    }
  }
  // Each dp rank's rows of a tp piece (the same on every tp rank).
  std::vector<std::vector<std::pair<int64_t, int64_t>>> dp_rows(local.size());
  if (layout == "tp+fsdp2") {
    for (size_t i = 0; i < local.size(); ++i) {
      const int64_t n = local[i].shape[0], c = rfsdp::ceil_div(n, dp);
      for (int64_t d = 0; d < dp; ++d) dp_rows[i].emplace_back(std::min(d * c, n), std::min((d + 1) * c, n));
    }
  } else if (layout == "tp+ragged") {
    const rfsdp::Plan plan = rfsdp::plan_unit(local, dp, 16);
    for (size_t i = 0; i < local.size(); ++i) dp_rows[i] = rfsdp::TensorShard::of_plan(plan, i, 0).rank_rows;
  } else {
    throw std::runtime_error("--tp: no layout " + layout);
  }
  for (size_t i = 0; i < mats.size(); ++i) {
    const bool col = colwise(mats[i].name);
    const int64_t R = mats[i].shape[0];
    std::vector<std::pair<int64_t, int64_t>> rows(world);
    for (int64_t d = 0; d < dp; ++d) {
      for (int64_t t = 0; t < tp; ++t) {
        // Colwise: part t's rows start at t R / tp; Rowwise: column part t's rows
        // count after the t parts before it (TensorShard::col_parts).
        const int64_t base = col ? t * (R / tp) : t * R;
        rows[d * tp + t] = {base + dp_rows[i][d].first, base + dp_rows[i][d].second};
      }
    }
    out.push_back(col ? rfsdp::TensorShard::rows_of(mats[i].name, mats[i].shape, 1, rows[0].first,
                                                    rows[0].second, rows)
                      : rfsdp::TensorShard::column_parts(mats[i].name, mats[i].shape, static_cast<int>(tp),
                                                         rows[0].first, rows[0].second, rows));
  }
  return out;
}

int muon_tp(const std::string& zoo, const std::string& only, int64_t dp, int64_t tp) {
  std::printf("Muon's owner exchange per step on a (dp=%lld, tp=%lld) mesh, %lld ranks, on paper from "
              "the layout (MuonLayout::planned); fp32, 4 bytes an element each way. blocks: Newton-Schulz "
              "blocks (whole matrices, or q/k/v per head); whole: blocks one rank holds (nothing moves); "
              "GiB total: every rank's sends; across tp: between ranks of different tp index; MiB/rank: "
              "sent by one rank, max and mean. Layouts: see the file's header.\n\n",
              static_cast<long long>(dp), static_cast<long long>(tp), static_cast<long long>(dp * tp));
  std::printf("%-22s %-9s %-6s | %6s %6s | %10s %10s | %10s %10s | %8s\n", "unit", "layout", "blocks",
              "blocks", "whole", "GiB total", "across tp", "MiB/rk max", "MiB/rk mean", "flops m/m");
  const int64_t world = dp * tp;
  for (auto& [unit_name, mats] : zoo_block_matrices(zoo, only)) {
    for (auto& t : mats) t.granule_rows = 1;
    for (const char* layout : {"fsdp", "tp+fsdp2", "tp+ragged"}) {
      std::vector<rfsdp::TensorShard> shards;
      try {
        shards = tp_layout(unit_name, mats, layout, dp, tp);
      } catch (const std::exception& e) {
        std::printf("%-22s %-9s: %s\n", unit_name.c_str(), layout, e.what());
        continue;
      }
      for (bool heads : {false, true}) {
        std::vector<std::vector<int64_t>> split;
        for (const auto& s : shards) {
          const int64_t h = heads ? head_rows(unit_name, s.name) : 0;
          split.push_back(h > 0 && s.shape[0] % h == 0 ? std::vector<int64_t>(s.shape[0] / h, h)
                                                       : std::vector<int64_t>{});
        }
        std::optional<rfsdp::MuonLayout> planned;
        try {
          planned.emplace(rfsdp::MuonLayout::planned(static_cast<int>(world), shards,
                                                     std::vector<int>(shards.size(), 5), split));
        } catch (const std::exception& e) {
          std::printf("%-22s %-9s %-6s: %s\n", unit_name.c_str(), layout, heads ? "heads" : "whole", e.what());
          continue;
        }
        const rfsdp::MuonLayout& ml = *planned;
        const rfsdp::OwnerExchange& x = ml.exchange();
        std::vector<double> sent(world, 0.0);
        double total = 0, across = 0;
        int64_t whole = 0;
        for (size_t u = 0; u < x.size(); ++u) {
          const int o = x.units()[u].owner;
          for (int r = 0; r < world; ++r) {
            const auto [b, e] = x.piece(u, r);
            const double n = static_cast<double>(e - b);
            if (e - b == x.units()[u].numel()) ++whole;
            if (r == o || n == 0) continue;
            sent[r] += 4 * n;  // its piece to the root
            sent[o] += 4 * n;  // and back
            total += 8 * n;
            if (r % tp != o % tp) across += 8 * n;
          }
        }
        double mean = 0;
        for (double v : sent) mean += v / world;
        const double gib = 1.0 / (1 << 30), mib = 1.0 / (1 << 20);
        std::printf("%-22s %-9s %-6s | %6zu %6lld | %10.3f %10.3f | %10.2f %10.2f | %8.3f\n",
                    unit_name.c_str(), layout, heads ? "heads" : "whole", x.size(),
                    static_cast<long long>(whole), total * gib, across * gib,
                    *std::max_element(sent.begin(), sent.end()) * mib, mean * mib, ml.flop_imbalance());
      }
    }
  }
  return 0;
}

std::vector<int64_t> parse_list(const char* text) {
  std::vector<int64_t> v;
  std::stringstream s(text);
  std::string item;
  while (std::getline(s, item, ',')) v.push_back(std::stoll(item));
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  std::string zoo = RFSDP_ZOO_DIR, only;
  std::vector<int64_t> world_sizes = {8, 64, 1024, 16384};
  bool blocks = false, roots = false, tiles = false;
  int64_t tp_dp = 0, tp_tp = 0;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--zoo") && i + 1 < argc) {
      zoo = argv[++i];
    } else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) {
      only = argv[++i];
    } else if (!std::strcmp(argv[i], "--world-sizes") && i + 1 < argc) {
      world_sizes = parse_list(argv[++i]);
    } else if (!std::strcmp(argv[i], "--tiles")) {
      tiles = true;
      world_sizes = {8, 64, 1024};
    } else if (!std::strcmp(argv[i], "--roots")) {
      roots = true;
      world_sizes = {8, 64, 1024};
    } else if (!std::strcmp(argv[i], "--tp") && i + 1 < argc) {
      const std::string v = argv[++i];
      const size_t x = v.find('x');
      tp_dp = x == std::string::npos ? 0 : std::stoll(v.substr(0, x));
      tp_tp = x == std::string::npos ? 0 : std::stoll(v.substr(x + 1));
      if (tp_dp < 1 || tp_tp < 1) {
        std::fprintf(stderr, "bench_planner: --tp takes DPxTP (128x8), not %s\n", v.c_str());
        return 2;
      }
    } else if (!std::strcmp(argv[i], "--blocks")) {
      blocks = true;
      world_sizes = {8, 64, 1024, 8192};
    } else {
      std::fprintf(stderr, "usage: bench_planner [--zoo DIR] [--only SUBSTRING] [--world-sizes "
                           "8,64,...] [--blocks] [--roots] [--tiles] [--tp DPxTP]\n");
      return 2;
    }
  }
  if (blocks) return pad_to_block(zoo, only, world_sizes);
  if (roots) return muon_roots(zoo, only, world_sizes);
  if (tiles) return shampoo_tiles(zoo, only, world_sizes);
  if (tp_tp) return muon_tp(zoo, only, tp_dp, tp_tp);
  const std::vector<Mode> modes = {{"1", 1}, {"16", 16}, {"32", 32}, {"128", 128}, {"whole", 0}};
  const int64_t align_bytes = 16;
  std::printf("Granule: rows per granule for every tensor; 'whole' = each Muon matrix whole "
              "(2-D whole, fused experts one expert each).\n");
  std::printf("1 buffer: one flat buffer per unit; k buffers: the planner's choice of up to %d "
              "buffers (one collective each, %lld bytes\ncharged per collective). pad%% = padding "
              "of the sharded buffers; S/SB = one buffer's S over the structural bound (also a\n"
              "multiple of the granule of every tensor that spans two rank boundaries; 1.0000 = "
              "optimal for one buffer); S/AB = S over the\nbound for any number of buffers "
              "(ceil(sum n / m), and the largest granule a cut tensor needs); cut = granules split "
              "across ranks.\n\n",
              rfsdp::PlannerOptions{}.max_buffers,
              static_cast<long long>(rfsdp::PlannerOptions{}.collective_cost_bytes));
  std::printf("%-26s %5s %6s | %8s %8s | %8s %4s %8s %8s | %8s %8s | %8s %8s\n", "unit", "gran",
              "m", "1buf pad", "S/SB", "kbuf pad", "bufs", "S/AB", "plan ms", "flat pad",
              "flat cut", "fsdp2 pad", "f2 cut");
  rfsdp::PlannerOptions one_buffer;
  one_buffer.max_buffers = 1;
  double worst_ms = 0, worst_ms_at_16k = 0, worst_pad_1024[2] = {0, 0}, worst_pad_1024_128 = 0;
  for (const auto& file : zoo_files(zoo)) {
    const std::string unit_name = file.substr(0, file.size() - 5);
    if (!only.empty() && unit_name.find(only) == std::string::npos) continue;
    const auto unit = rfsdp::unit_from_json(read_file(zoo + "/" + file));
    for (const Mode& mode : modes) {
      const auto specs = with_granules(unit, mode);
      for (int64_t m : world_sizes) {
        const rfsdp::Plan single = rfsdp::plan_unit(specs, m, align_bytes, one_buffer);
        const rfsdp::Plan plan = rfsdp::plan_unit(specs, m, align_bytes);
        rfsdp::validate_plan(single);
        rfsdp::validate_plan(plan);
        if (plan.shard_elems > single.shard_elems) {
          std::fprintf(stderr, "%s: more buffers padded more than one\n", unit_name.c_str());
          return 1;
        }
        if (m == 1024 && (mode.rows == 1 || mode.rows == 16)) {
          double& w = worst_pad_1024[mode.rows == 16];
          w = std::max(w, plan.padding_fraction());
        }
        if (m == 1024 && mode.rows == 128) {
          worst_pad_1024_128 = std::max(worst_pad_1024_128, plan.padding_fraction());
        }
        const Baseline flat = flat_sharding(specs, m, plan.align_elems());
        const Baseline f2 = fsdp2_shard0(specs, m);
        const double ms = plan.plan_seconds * 1e3;
        worst_ms = std::max(worst_ms, ms);
        if (m == 16384) worst_ms_at_16k = std::max(worst_ms_at_16k, ms);
        const int64_t sb = rfsdp::structural_lower_bound(specs, m, align_bytes);
        std::printf("%-26s %5s %6lld | %8.3f %8.4f | %8.3f %4zu %8.4f %8.2f | %8.3f %8lld | "
                    "%8.3f %8lld\n",
                    unit_name.c_str(), mode.label.c_str(), static_cast<long long>(m),
                    100.0 * single.padding_fraction(),
                    static_cast<double>(single.shard_elems) / sb,
                    100.0 * plan.padding_fraction(), plan.num_buffers(),
                    static_cast<double>(plan.shard_elems) /
                        rfsdp::any_buffers_lower_bound(specs, m, align_bytes), ms,
                    100.0 * flat.padding, static_cast<long long>(flat.cut), 100.0 * f2.padding,
                    static_cast<long long>(f2.cut));
      }
    }
  }
  std::printf("\nslowest plan: %.2f ms (at m = 16384: %.2f ms)\n", worst_ms, worst_ms_at_16k);
  std::printf("worst padding at m = 1024 with k buffers: %.3f %% (1-row granules), %.3f %% "
              "(16 rows), %.3f %% (128 rows)\n",
              100 * worst_pad_1024[0], 100 * worst_pad_1024[1], 100 * worst_pad_1024_128);
  return 0;
}
