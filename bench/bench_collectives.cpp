// bench_collectives: unshard and reduce_grads of a Llama-style block unit on 2
// (--ranks M) ranks (threads over Gloo), RaggedFSDP's flat-buffer unit against an
// FSDP2-style path written here for comparison:
//   all-gather: per-parameter copy-in of the local Shard(0) chunks to a flat
//               send buffer, all-gather, copy-out into per-parameter tensors;
//   reduce:     chunk-cat of the full gradients into a rank-major buffer, then
//               reduce-scatter.
// Both use the same Comm, so a backend fallback costs both the same.
// Then HSDP on 4 ranks: the same unit sharded over 4 (plain FSDP), 2 x 2 and
// 4 x 1 (plain replication): time and bytes sent per rank.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <vector>

#include "bench/bench_util.h"
#include "core/comm/hybrid_groups.h"
#include "tests/support/local_ranks.h"
#include "core/ragged/int_math.h"
#include "core/ragged/planner.h"
#include "fsdp/fsdp_unit.h"

namespace {

using rfsdp::bench::median;

using rfsdp::TensorSpec;
using Clock = std::chrono::steady_clock;

std::vector<TensorSpec> llama_block(int64_t h, int64_t kv, int64_t ffn) {
  auto t = [](std::string n, std::vector<int64_t> s) {
    TensorSpec x;
    x.name = std::move(n);
    x.shape = std::move(s);
    return x;
  };
  return {t("input_layernorm", {h}), t("q_proj", {h, h}),        t("k_proj", {kv, h}),
          t("v_proj", {kv, h}),      t("o_proj", {h, h}),        t("post_attention_layernorm", {h}),
          t("gate_proj", {ffn, h}),  t("up_proj", {ffn, h}),     t("down_proj", {h, ffn})};
}

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// FSDP2's layout: every tensor cut along dim 0 into m chunks of ceil(d0/m) rows.
struct Fsdp2Layout {
  std::vector<int64_t> chunk_rows, row_elems, offset;  // offset of the chunk in a rank's piece
  int64_t per_rank = 0;
};

Fsdp2Layout fsdp2_layout(const std::vector<TensorSpec>& unit, int m) {
  Fsdp2Layout l;
  for (const auto& t : unit) {
    const int64_t d0 = t.shape[0];
    l.chunk_rows.push_back(rfsdp::ceil_div(d0, m));
    l.row_elems.push_back(t.numel() / d0);
    l.offset.push_back(l.per_rank);
    l.per_rank += l.chunk_rows.back() * l.row_elems.back();
  }
  return l;
}

struct Result {
  std::vector<double> gather_ms, reduce_ms;
  int64_t gather_copied = 0, reduce_copied = 0;
};

// The flat collectives' algorithms compared for the ragged unit (--algorithms).
std::vector<std::pair<rfsdp::FlatAlgorithm, const char*>> kAlgorithms = {
    {rfsdp::FlatAlgorithm::Native, "native"}, {rfsdp::FlatAlgorithm::PerRank, "per-rank"},
    {rfsdp::FlatAlgorithm::AllToAll, "all-to-all"}};

}  // namespace

// HSDP: 4 ranks (threads, Gloo, the default flat algorithms) as (replicas x shard
// size) = 1 x 4, 2 x 2, 4 x 1; unshard and reduce_grads(Avg) of the unit, medians
// of rank 0, beside the bytes each rank sends under ring algorithms (the model
// NCCL follows): gather and reduce-scatter (m - 1) S, all-reduce 2 (r - 1) / r S.
void hsdp_section(const std::vector<TensorSpec>& unit, int iters) {
  constexpr int kWorld = 4;
  std::printf("\nHSDP, %d ranks (threads, gloo): replicas x shard size; MiB each rank sends in "
              "ring algorithms\n", kWorld);
  std::printf("%-10s | %8s | %12s %12s | %12s %12s\n", "mesh", "S", "unshard ms", "ring MiB",
              "reduce ms", "ring MiB");
  double base_g = 0, base_r = 0;
  for (int m : {4, 2, 1}) {
    const rfsdp::Plan plan = rfsdp::plan_unit(unit, m, 16);
    std::vector<double> gather_ms, reduce_ms;
    std::mutex mu;
    rfsdp::run_local_ranks(kWorld, [&](rfsdp::Comm& world) {
      rfsdp::HybridGroups g = rfsdp::hybrid_groups(world, m);
      rfsdp::FSDPUnit u(g.shard, g.replicate, plan);
      std::vector<at::Tensor> full;
      for (const auto& t : unit) full.push_back(at::ones(t.shape));
      u.shard(full);
      for (int it = 0; it < iters + 2; ++it) {
        world.barrier().wait();
        auto t0 = Clock::now();
        u.unshard().wait();
        const double gm = ms_since(t0);
        u.reshard();
        u.prepare_grads();
        world.barrier().wait();
        t0 = Clock::now();
        u.reduce_grads(rfsdp::ReduceOp::Avg).wait();
        const double rm = ms_since(t0);
        u.zero_grad();
        if (it >= 2 && world.rank() == 0) {
          std::lock_guard<std::mutex> lock(mu);
          gather_ms.push_back(gm);
          reduce_ms.push_back(rm);
        }
      }
    });
    const double slice_mb = plan.shard_elems * 4.0 / (1 << 20);
    const int r = kWorld / m;
    const double gather_mb = (m - 1) * slice_mb;
    const double reduce_mb = (m - 1) * slice_mb + 2.0 * (r - 1) / r * slice_mb;
    if (m == kWorld) {
      base_g = median(gather_ms);
      base_r = median(reduce_ms);
    }
    const std::string mesh = std::to_string(kWorld / m) + " x " + std::to_string(m);
    std::printf("%-10s | %8lld | %12.2f %12.2f | %12.2f %12.2f   (time %.2fx, %.2fx of 1 x 4)\n",
                mesh.c_str(), static_cast<long long>(plan.shard_elems), median(gather_ms),
                gather_mb, median(reduce_ms), reduce_mb,
                median(gather_ms) / base_g, median(reduce_ms) / base_r);
  }
}

int main(int argc, char** argv) {
  int iters = 15, ranks = 2;
  int64_t hidden = 1024, kv = 256, ffn = 2816;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--hidden") && i + 1 < argc) {
      hidden = std::atoll(argv[++i]);
      kv = hidden / 4;
      ffn = hidden * 11 / 4;
    } else if (!std::strcmp(argv[i], "--algorithms") && i + 1 < argc) {
      const std::string a = argv[++i];
      kAlgorithms.clear();
      if (a.find("native") != std::string::npos) kAlgorithms.push_back({rfsdp::FlatAlgorithm::Native, "native"});
      if (a.find("per-rank") != std::string::npos) kAlgorithms.push_back({rfsdp::FlatAlgorithm::PerRank, "per-rank"});
      if (a.find("all-to-all") != std::string::npos) kAlgorithms.push_back({rfsdp::FlatAlgorithm::AllToAll, "all-to-all"});
    } else if (!std::strcmp(argv[i], "--ranks") && i + 1 < argc) {
      ranks = std::atoi(argv[++i]);
    } else {
      kAlgorithms.clear();
    }
    if (kAlgorithms.empty()) {
      std::fprintf(stderr, "usage: bench_collectives [--iters N] [--hidden H] "
                           "[--algorithms native,per-rank,all-to-all] [--ranks M]\n");
      return 2;
    }
  }
  const int m = ranks;
  const auto unit = llama_block(hidden, kv, ffn);
  const rfsdp::Plan plan = rfsdp::plan_unit(unit, m, 16);
  const Fsdp2Layout f2 = fsdp2_layout(unit, m);
  std::vector<Result> ragged(kAlgorithms.size());
  Result fsdp2;
  std::mutex mu;

  rfsdp::run_local_ranks(m, [&](rfsdp::Comm& c) {
    auto comm = std::shared_ptr<rfsdp::Comm>(&c, [](rfsdp::Comm*) {});
    std::vector<at::Tensor> full;
    for (const auto& t : unit) full.push_back(at::randn(t.shape));
    std::vector<Result> mine_r(kAlgorithms.size());
    Result mine_f;

    // RaggedFSDP: in-place gather into the unit's buffer; reduce-scatter into the
    // local slice; once per algorithm of the flat collectives.
    rfsdp::FSDPUnit u(comm, plan);
    u.shard(full);
    for (size_t a = 0; a < kAlgorithms.size(); ++a)
    for (int it = 0; it < iters + 2; ++it) {
      // all-to-all is the reduce-scatter's alone: the gather keeps its default
      const rfsdp::FlatAlgorithm algo = kAlgorithms[a].first;
      c.set_flat_algorithms(algo == rfsdp::FlatAlgorithm::AllToAll ? rfsdp::FlatAlgorithm::Auto : algo, algo);
      c.reset_stats();
      c.barrier().wait();
      auto t0 = Clock::now();
      u.unshard().wait();
      const double g = ms_since(t0);
      const int64_t gc = c.stats().bytes_copied;
      u.reshard();
      u.prepare_grads();
      for (size_t i = 0; i < unit.size(); ++i) u.full_grad(i).fill_(1.0f);
      c.reset_stats();
      c.barrier().wait();
      t0 = Clock::now();
      u.reduce_grads().wait();
      const double r = ms_since(t0);
      if (it >= 2) {  // 2 warm-up rounds
        mine_r[a].gather_ms.push_back(g);
        mine_r[a].reduce_ms.push_back(r);
        mine_r[a].gather_copied = gc;
        mine_r[a].reduce_copied = c.stats().bytes_copied;
      }
    }
    c.set_flat_algorithms(rfsdp::FlatAlgorithm::Auto, rfsdp::FlatAlgorithm::Auto);

    // FSDP2-style: per-parameter chunks, copy-in / all-gather / copy-out; chunk-cat / reduce-scatter.
    std::vector<at::Tensor> local_chunks, params, grads;
    for (size_t i = 0; i < unit.size(); ++i) {
      at::Tensor padded = at::zeros({f2.chunk_rows[i] * m, f2.row_elems[i]});
      padded.narrow(0, 0, unit[i].shape[0]).copy_(full[i].reshape({unit[i].shape[0], -1}));
      local_chunks.push_back(padded.narrow(0, c.rank() * f2.chunk_rows[i], f2.chunk_rows[i]).clone());
      params.push_back(at::empty(unit[i].shape));
      grads.push_back(at::ones(unit[i].shape));
    }
    // As FSDP2 does, every unshard allocates the all-gather output and the
    // unsharded parameters' storage, and every reduce allocates the
    // reduce-scatter input and output (RaggedFSDP allocates its global buffer).
    at::Tensor send = at::empty({f2.per_rank});
    for (int it = 0; it < iters + 2; ++it) {
      c.reset_stats();
      c.barrier().wait();
      int64_t own = 0;
      auto t0 = Clock::now();
      at::Tensor gathered = at::empty({m * f2.per_rank});
      for (size_t i = 0; i < unit.size(); ++i) params[i] = at::empty(unit[i].shape);
      for (size_t i = 0; i < unit.size(); ++i) {  // copy-in
        send.narrow(0, f2.offset[i], local_chunks[i].numel()).copy_(local_chunks[i].reshape(-1));
        own += local_chunks[i].numel() * 4;
      }
      c.all_gather_flat(gathered, send).wait();
      for (size_t i = 0; i < unit.size(); ++i) {  // copy-out
        const int64_t d0 = unit[i].shape[0];
        at::Tensor dst = params[i].reshape({d0, -1});
        for (int r = 0; r < m; ++r) {
          const int64_t row0 = r * f2.chunk_rows[i];
          const int64_t rows = std::max<int64_t>(0, std::min(f2.chunk_rows[i], d0 - row0));
          if (rows == 0) continue;
          dst.narrow(0, row0, rows)
              .copy_(gathered.narrow(0, r * f2.per_rank + f2.offset[i], rows * f2.row_elems[i])
                         .view({rows, f2.row_elems[i]}));
          own += rows * f2.row_elems[i] * 4;
        }
      }
      const double g = ms_since(t0);
      const int64_t gc = own + c.stats().bytes_copied;
      c.reset_stats();
      c.barrier().wait();
      own = 0;
      t0 = Clock::now();
      at::Tensor rs_in = at::zeros({m * f2.per_rank}), rs_out = at::empty({f2.per_rank});
      for (size_t i = 0; i < unit.size(); ++i) {  // chunk-cat
        const int64_t d0 = unit[i].shape[0];
        at::Tensor src = grads[i].reshape({d0, -1});
        for (int r = 0; r < m; ++r) {
          const int64_t row0 = r * f2.chunk_rows[i];
          const int64_t rows = std::max<int64_t>(0, std::min(f2.chunk_rows[i], d0 - row0));
          if (rows == 0) continue;
          rs_in.narrow(0, r * f2.per_rank + f2.offset[i], rows * f2.row_elems[i])
              .copy_(src.narrow(0, row0, rows).reshape(-1));
          own += rows * f2.row_elems[i] * 4;
        }
      }
      c.reduce_scatter_flat(rs_in, rs_out, rfsdp::ReduceOp::Avg).wait();
      const double r = ms_since(t0);
      if (it >= 2) {
        mine_f.gather_ms.push_back(g);
        mine_f.reduce_ms.push_back(r);
        mine_f.gather_copied = gc;
        mine_f.reduce_copied = own + c.stats().bytes_copied;
      }
    }
    if (c.rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      ragged = mine_r;
      fsdp2 = mine_f;
    }
  });

  const double mb = 1.0 / (1 << 20);
  int64_t params = 0;
  for (const auto& t : unit) params += t.numel();
  std::printf("Llama-style block unit: hidden %lld, kv %lld, ffn %lld: %.2fM fp32 parameters, "
              "%d ranks (threads, gloo), %d iterations, medians of rank 0\n",
              static_cast<long long>(hidden), static_cast<long long>(kv),
              static_cast<long long>(ffn), params / 1e6, m, iters);
  std::printf("ragged plan: S = %lld (padding %.3f%%); FSDP2 Shard(0): %lld per rank\n\n",
              static_cast<long long>(plan.shard_elems), 100 * plan.padding_fraction(),
              static_cast<long long>(f2.per_rank));
  std::printf("%-22s | %12s %14s | %12s %14s\n", "path", "unshard ms", "copied MiB",
              "reduce ms", "copied MiB");
  for (size_t a = 0; a < kAlgorithms.size(); ++a) {
    const std::string name = std::string("RaggedFSDP ") + kAlgorithms[a].second;
    std::printf("%-22s | %12.2f %14.2f | %12.2f %14.2f\n", name.c_str(),
                median(ragged[a].gather_ms), ragged[a].gather_copied * mb,
                median(ragged[a].reduce_ms), ragged[a].reduce_copied * mb);
  }
  std::printf("%-22s | %12.2f %14.2f | %12.2f %14.2f\n", "FSDP2-style (auto)",
              median(fsdp2.gather_ms), fsdp2.gather_copied * mb, median(fsdp2.reduce_ms),
              fsdp2.reduce_copied * mb);
  std::printf("\nratios to RaggedFSDP per-rank (time):\n");
  const Result& base = ragged.back();
  for (size_t a = 0; a + 1 < kAlgorithms.size(); ++a) {
    std::printf("  %-20s  unshard %.2fx  reduce %.2fx\n", kAlgorithms[a].second,
                median(ragged[a].gather_ms) / median(base.gather_ms),
                median(ragged[a].reduce_ms) / median(base.reduce_ms));
  }
  hsdp_section(unit, iters);
  return 0;
}
