// Uses the installed package through <rfsdp/...> only: plans a unit and checks
// every rank boundary against the granules, quantises a random tensor and checks
// every code against a scan of the code values, takes AdamW8bit steps on a
// whole tensor. Exits non-zero on any mismatch.
#include <rfsdp/core/ragged/planner.h>
#include <rfsdp/optimizers/adamw/adamw.h>
#include <rfsdp/quant/ops.h>
#include <rfsdp/rfsdp_version.h>

#include <cmath>
#include <cstdio>
#include <random>

namespace {

int failures = 0;
void expect(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "FAIL: %s\n", what);
    ++failures;
  }
}

}  // namespace

int main() {
  std::random_device rd;
  std::mt19937_64 rng((static_cast<uint64_t>(rd()) << 32) ^ rd());
  // Plan: random shapes and granules; a boundary inside a tensor sits on a granule edge.
  std::vector<rfsdp::TensorSpec> specs;
  for (int i = 0; i < 6; ++i) {
    rfsdp::TensorSpec t;
    t.name = "t" + std::to_string(i);
    t.shape = {static_cast<int64_t>(1 + rng() % 300), static_cast<int64_t>(1 + rng() % 64)};
    t.granule_rows = static_cast<int64_t>(1 + rng() % 8);
    specs.push_back(t);
  }
  const int64_t m = 4;
  const rfsdp::Plan plan = rfsdp::plan_unit(specs, m);
  for (size_t i = 0; i < specs.size(); ++i) {
    const int64_t off = plan.offsets[i], n = specs[i].numel();
    for (int64_t k = 1; k < m; ++k) {
      const int64_t cut = k * plan.shard_elems;
      if (cut > off && cut < off + n) {
        expect((cut - off) % (specs[i].granule_rows * specs[i].row_elems()) == 0,
               "a rank boundary cuts a granule");
      }
    }
  }
  // Quantise: each code is a nearest code of x / absmax.
  const at::Tensor x = at::randn({50, 70});
  const at::Tensor code = rfsdp::quant::dynamic_map(true);
  const auto q = rfsdp::quant::quantize_blockwise(x, code, rfsdp::quant::BlockShape::blocks(256));
  const float* xv = x.data_ptr<float>();
  const float* cv = code.data_ptr<float>();
  for (int64_t e = 0; e < x.numel(); ++e) {
    const double a = q.absmax[e / 256].item<float>();
    const double v = a > 0 ? xv[e] / a : 0.0;
    const int got = q.codes.view(-1)[e].item<uint8_t>();
    double best = 1e9;
    for (int c = 0; c < 256; ++c) best = std::min(best, std::fabs(v - cv[c]));
    expect(std::fabs(v - cv[got]) <= best + 1e-6, "a code is not the nearest");
  }
  // AdamW8bit on one whole tensor: the loss of a least-squares fit falls.
  at::Tensor w = at::zeros({64, 64});
  const at::Tensor target = at::randn({64, 64});
  rfsdp::ParamShard shard = rfsdp::whole_param("w", w, at::zeros({64, 64}));
  rfsdp::AdamW8bitConfig config;
  config.min_8bit_size = 1;
  rfsdp::AdamW8bit opt({shard}, {1e-2f, 0.9f, 0.999f, 1e-8f, 0.0f}, config);
  const double first = (w - target).pow(2).mean().item<double>();
  // 300 steps: the loss is then about 1 % of the first (at 200 steps it was 4-5 %, too
  // near the 5 % bound: 1 run in about 30 failed on AMD EPYC).
  for (int step = 0; step < 300; ++step) {
    shard.grad.copy_(2.0 * (w - target) / w.numel());
    opt.step();
  }
  const double last = (w - target).pow(2).mean().item<double>();
  expect(last < 0.05 * first, "AdamW8bit did not fit");
  std::printf("rfsdp %s from the installed package: plan S=%lld, %lld codes checked, loss %.4f -> %.4f: %s\n",
              RFSDP_VERSION, static_cast<long long>(plan.shard_elems),
              static_cast<long long>(x.numel()), first, last, failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
