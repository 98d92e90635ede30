// bench_muon: one Muon optimizer step over the matrices of a GPT-like model
// (per layer: qkv [3d, d], proj [d, d], fc [4d, d], out [d, 4d]; one FSDP unit
// per layer) on 1, 2 and 4 ranks (threads over Gloo, one compute thread each):
//   ragged-root: rfsdp::Muon on ragged shards (granule 1): gather each matrix to
//                its load-balanced root, Newton–Schulz there, scatter back;
//   gather-all:  ZeRO-1 style, written here: every rank all-gathers the full
//                update of every unit and runs Newton–Schulz on every matrix;
//   whole:       rfsdp::Muon on shards planned with every matrix whole on one
//                rank: nothing moves.
// Prints the median step time, the speedup over the 1-rank step, bytes sent per
// rank per step and the Newton–Schulz flop imbalance (max/mean over ranks).
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "tests/support/local_ranks.h"
#include "core/ragged/planner.h"
#include "optimizers/muon/muon.h"

namespace {

using rfsdp::bench::median;

using Clock = std::chrono::steady_clock;

std::vector<rfsdp::TensorSpec> layer(int64_t d, bool whole) {
  auto t = [whole](std::string n, std::vector<int64_t> s) {
    rfsdp::TensorSpec x;
    x.name = std::move(n);
    x.shape = std::move(s);
    x.granule_rows = whole ? rfsdp::kWholeTensor : 1;
    return x;
  };
  return {t("qkv", {3 * d, d}), t("proj", {d, d}), t("fc", {4 * d, d}), t("out", {d, 4 * d})};
}

struct Result {
  double ms = 0, sent_mib = 0, imbalance = 1;
};

Result run(const std::string& variant, int64_t d, int layers, int world, int iters) {
  const bool whole = variant == "whole";
  const rfsdp::Plan plan = rfsdp::plan_unit(layer(d, whole), world, 16);
  Result res;
  std::mutex mu;
  rfsdp::run_local_ranks(
      world,
      [&](rfsdp::Comm& comm) {
        auto shards = rfsdp::bench::random_shards(plan, layers, comm.rank());
        std::shared_ptr<rfsdp::Comm> cp(&comm, [](rfsdp::Comm*) {});
        std::vector<double> times;
        double imbalance = 1;
        if (variant != "gather-all") {
          rfsdp::Muon muon(shards, {}, {}, cp);
          imbalance = muon.layout().flop_imbalance();
          muon.step();  // warm-up
          comm.reset_stats();
          for (int it = 0; it < iters; ++it) {
            comm.barrier().wait();
            const auto t0 = Clock::now();
            muon.step();
            comm.barrier().wait();
            times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
          }
        } else {
          // ZeRO-1 Muon: momentum on the shard, all-gather every unit's update
          // into the plan's flat buffer (in place), Newton–Schulz on every matrix.
          std::vector<at::Tensor> mom;
          for (const auto& p : shards) mom.push_back(at::zeros_like(p.param));
          const int64_t S = plan.shard_elems;
          at::Tensor global = at::empty({world * S});
          const size_t per = plan.tensors.size();
          auto step = [&] {
            for (int l = 0; l < layers; ++l) {
              at::Tensor local = global.narrow(0, comm.rank() * S, S);
              for (size_t i = 0; i < per; ++i) {
                auto& p = shards[l * per + i];
                mom[l * per + i].lerp_(p.grad, 0.05);
                const auto r = plan.shard(i, comm.rank());
                local.narrow(0, r.local_offset, r.numel).copy_(p.grad.lerp(mom[l * per + i], 0.95).view(-1));
              }
              comm.all_gather_flat(global).wait();
              for (size_t i = 0; i < per; ++i) {
                auto& p = shards[l * per + i];
                const auto& t = plan.tensors[i];
                at::Tensor full = global.narrow(0, plan.offsets[i], t.numel()).view({t.shape[0], t.shape[1]});
                at::Tensor o = rfsdp::newton_schulz(full, 5) *
                               rfsdp::muon_update_scale(t.shape[0], t.shape[1], rfsdp::MuonAdjustLr::Original);
                const auto r = plan.shard(i, comm.rank());
                p.param.add_(o.narrow(0, r.row_begin, r.row_end - r.row_begin), -0.02);
              }
            }
          };
          step();
          comm.reset_stats();
          for (int it = 0; it < iters; ++it) {
            comm.barrier().wait();
            const auto t0 = Clock::now();
            step();
            comm.barrier().wait();
            times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
          }
        }
        // Comm counts the payload a rank contributes; alone, nothing leaves the rank.
        const double sent =
            world > 1 ? static_cast<double>(comm.stats().bytes_sent) / iters / (1 << 20) : 0.0;
        std::lock_guard<std::mutex> lock(mu);
        if (comm.rank() == 0) res.ms = median(times), res.imbalance = imbalance;
        res.sent_mib = std::max(res.sent_mib, sent);  // the busiest rank
      },
      std::chrono::minutes(10));
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t d = 256;
  int layers = 4, iters = 5;
  std::vector<int> worlds = {1, 2, 4};
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--dim")) d = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--layers")) layers = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--iters")) iters = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--worlds")) {
      worlds.clear();
      for (const char* s = argv[i + 1]; *s;) {
        worlds.push_back(std::atoi(s));
        while (*s && *s != ',') ++s;
        if (*s == ',') ++s;
      }
    } else {
      std::fprintf(stderr, "usage: bench_muon [--dim D] [--layers L] [--iters N] [--worlds 1,2,4]\n");
      return 2;
    }
  }
  at::set_num_threads(1);  // one compute thread per rank
  const double flops = layers * (rfsdp::newton_schulz_flops(3 * d, d, 5) + rfsdp::newton_schulz_flops(d, d, 5) +
                                 2 * rfsdp::newton_schulz_flops(4 * d, d, 5));
  std::printf("Muon step, GPT-like matrices: d=%lld, %d layers (%.1f M params), Newton-Schulz %.1f GFLOP/step;"
              " ranks are threads on %d cores (median of %d)\n",
              static_cast<long long>(d), layers, layers * 12.0 * d * d / 1e6, flops / 1e9,
              static_cast<int>(std::thread::hardware_concurrency()), iters);
  std::printf("%-6s %-12s %10s %12s %14s %10s\n", "ranks", "variant", "step ms", "vs 1 rank",
              "MiB sent/rank", "NS imbal.");
  std::map<std::string, double> one_rank;
  for (int w : worlds) {
    for (const std::string v : {"ragged-root", "gather-all", "whole"}) {
      const Result r = run(v, d, layers, w, iters);
      if (w == 1) one_rank[v] = r.ms;
      const double base = one_rank.count("ragged-root") ? one_rank["ragged-root"] : r.ms;
      std::printf("%-6d %-12s %10.1f %11.2fx %14.2f %10.2f\n", w, v.c_str(), r.ms, r.ms / base,
                  r.sent_mib, r.imbalance);
      std::fflush(stdout);
    }
  }
  std::printf("1-rank NS rate: %.1f GFLOP/s (one thread)\n", flops / (one_rank["ragged-root"] * 1e6));
  return 0;
}
