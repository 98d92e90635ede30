// bench_shampoo: rfsdp::Shampoo steps over the matrices of a GPT-like model (per
// layer: qkv [3d, d], proj [d, d], fc [4d, d], out [d, 4d] and a norm [d]; one
// unit per layer, planned with the Shampoo granule) on 1, 2 and 4 ranks (threads
// over Gloo, one compute thread each). Roots are computed every step here, so
// one run gives both parts of a step: the roots, and the rest (grafting, factor
// updates, preconditioning).
// Prints per world size: the median step, its root share, the step at
// precondition_frequency 20 (the rest + roots / 20), the speedup of that over one
// rank, factor and root bytes per rank (the largest), and the root flops' balance
// over ranks (max/mean).
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "tests/support/local_ranks.h"
#include "core/ragged/planner.h"
#include "optimizers/shampoo/shampoo.h"

namespace {

using rfsdp::bench::median;

using Clock = std::chrono::steady_clock;

std::vector<rfsdp::TensorSpec> layer(int64_t d, int64_t max_dim) {
  auto t = [&](std::string n, std::vector<int64_t> s) {
    rfsdp::TensorSpec x;
    x.name = std::move(n);
    x.shape = std::move(s);
    x.granule_rows = rfsdp::tile_granule_rows(x.shape, 1, max_dim);
    return x;
  };
  return {t("qkv", {3 * d, d}), t("proj", {d, d}), t("fc", {4 * d, d}), t("out", {d, 4 * d}),
          t("norm", {d})};
}

struct Result {
  double step_ms = 0, root_ms = 0, factor_mib = 0, imbalance = 1;
};

Result run(int64_t d, int layers, int64_t max_dim, int world, int iters) {
  const rfsdp::Plan plan = rfsdp::plan_unit(layer(d, max_dim), world, 16);
  Result res;
  std::mutex mu;
  rfsdp::run_local_ranks(
      world,
      [&](rfsdp::Comm& comm) {
        std::vector<rfsdp::ParamShard> shards = rfsdp::bench::random_shards(plan, layers, comm.rank());
        rfsdp::ShampooOptions o;
        // One random gradient makes a square tile's factor nearly singular; an
        // epsilon far above fp32's rounding of it keeps every root computable.
        o.epsilon = 1e-4;
        rfsdp::ShampooConfig c;
        c.max_preconditioner_dim = max_dim;
        c.precondition_frequency = 1;
        c.start_preconditioning_step = 1;
        rfsdp::Shampoo opt(shards, o, c, std::shared_ptr<rfsdp::Comm>(&comm, [](rfsdp::Comm*) {}));
        std::vector<double> steps, roots;
        for (int it = 0; it < iters + 1; ++it) {
          comm.barrier().wait();
          const double r0 = opt.root_seconds();
          const auto t0 = Clock::now();
          opt.step();
          const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
          if (it > 0) {  // one warm-up step
            steps.push_back(ms);
            roots.push_back((opt.root_seconds() - r0) * 1e3);
          }
        }
        // Every rank's numbers on every rank; the slowest rank sets the pace.
        const at::Tensor mine = at::tensor({median(steps), median(roots),
                                            static_cast<double>(opt.factor_bytes()),
                                            opt.root_flops()}, at::kDouble);
        at::Tensor all = at::zeros({world * 4}, at::kDouble);
        comm.all_gather_flat(all, mine).wait();
        all = all.view({world, 4});
        if (comm.rank() == 0) {
          std::lock_guard<std::mutex> lock(mu);
          const int64_t slowest = all.select(1, 0).argmax().item<int64_t>();
          res.step_ms = all[slowest][0].item<double>();
          res.root_ms = all[slowest][1].item<double>();
          res.factor_mib = all.select(1, 2).max().item<double>() / (1 << 20);
          const double mean_flops = all.select(1, 3).mean().item<double>();
          res.imbalance = mean_flops > 0 ? all.select(1, 3).max().item<double>() / mean_flops : 1.0;
        }
      },
      std::chrono::minutes(10));
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t d = 512, max_dim = 256;
  int layers = 4, iters = 5;
  std::vector<int> worlds = {1, 2, 4};
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--dim") && i + 1 < argc) {
      d = std::atoll(argv[++i]);
    } else if (!std::strcmp(argv[i], "--layers") && i + 1 < argc) {
      layers = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--max-preconditioner-dim") && i + 1 < argc) {
      max_dim = std::atoll(argv[++i]);
    } else if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--worlds") && i + 1 < argc) {
      worlds.clear();
      for (char* s = std::strtok(argv[++i], ","); s; s = std::strtok(nullptr, ",")) {
        worlds.push_back(std::atoi(s));
      }
    } else {
      std::fprintf(stderr, "usage: bench_shampoo [--dim 512] [--layers 4] "
                           "[--max-preconditioner-dim 256] [--iters 5] [--worlds 1,2,4]\n");
      return 2;
    }
  }
  const int64_t params_per_layer = 12 * d * d + d;
  std::printf("Shampoo over a GPT-like model: width %lld, %d layers (%.2fM parameters), tiles of at "
              "most %lld; ranks are threads over Gloo with one compute thread each; medians of "
              "%d steps, the slowest rank\n\n",
              static_cast<long long>(d), layers, params_per_layer * layers / 1e6,
              static_cast<long long>(max_dim), iters);
  std::printf("%6s | %10s %10s %8s | %14s %8s | %14s %12s\n", "ranks", "step ms", "roots ms",
              "roots %", "step ms @f=20", "speedup", "factors MiB", "root flops");
  double base = 0;
  for (int world : worlds) {
    const Result r = run(d, layers, max_dim, world, iters);
    const double at20 = (r.step_ms - r.root_ms) + r.root_ms / 20;
    if (base == 0) base = at20;
    std::printf("%6d | %10.1f %10.1f %7.0f%% | %14.1f %7.2fx | %14.2f %11.3f\n", world, r.step_ms,
                r.root_ms, 100 * r.root_ms / r.step_ms, at20, base / at20, r.factor_mib,
                r.imbalance);
  }
  std::printf("\nroot flops: max/mean over ranks of the eigendecompositions each rank owns (1 = "
              "balanced); factors: L, R and both roots of the rank's tiles.\n");
  return 0;
}
