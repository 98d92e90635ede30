// bench_planner: the RaggedShard planner over the model zoo, beside the two
// formats the veScale-FSDP paper compares against, from the same shapes:
//   flat  - element-wise flat sharding (FSDP1 / DeepSpeed ZeRO-3): the unit's
//           tensors concatenated, cut into m equal pieces;
//   fsdp2 - FSDP2's Shard(0): every tensor cut along dim 0 into m chunks of
//           ceil(dim0 / m) rows, padded.
// For each: padding (% of the sharded buffer) and how many granules (the
// blocks an optimizer or quantiser needs whole) are cut across ranks.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <dirent.h>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/ragged/int_math.h"
#include "core/ragged/plan_json.h"
#include "core/ragged/planner.h"

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

Baseline fsdp2_shard0(const std::vector<TensorSpec>& unit, int64_t m) {
  int64_t total = 0, per_rank = 0;
  Baseline b;
  std::vector<int64_t> cuts;
  for (const auto& t : unit) {
    const int64_t dim0 = t.shape.empty() ? 1 : t.shape[0];
    const int64_t row0 = t.numel() / dim0;
    const int64_t chunk = rfsdp::ceil_div(dim0, m);
    total += t.numel();
    per_rank += chunk * row0;
    cuts.clear();
    for (int64_t i = 1; i < m && i * chunk < dim0; ++i) cuts.push_back(i * chunk * row0);
    b.cut += granules_cut(t, cuts);
  }
  b.padding = 1.0 - static_cast<double>(total) / static_cast<double>(m * per_rank);
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
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--zoo") && i + 1 < argc) {
      zoo = argv[++i];
    } else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) {
      only = argv[++i];
    } else if (!std::strcmp(argv[i], "--world-sizes") && i + 1 < argc) {
      world_sizes = parse_list(argv[++i]);
    } else {
      std::fprintf(stderr,
                   "usage: bench_planner [--zoo DIR] [--only SUBSTRING] [--world-sizes 8,64,...]\n");
      return 2;
    }
  }
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
