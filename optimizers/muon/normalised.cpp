// NorMuon's per-row normalisation and Hyperball's projection of the Muon update,
// on the rows of each matrix this rank holds after Newton–Schulz: the Frobenius
// norms of a block (NorMuon) or of a parameter (Hyperball) that ranks cut are
// float64 partial sums, every cut parameter's in one all-reduce.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "optimizers/common/hyperball.h"
#include "optimizers/muon/muon.h"
#include "optimizers/muon/step.h"

namespace rfsdp {

namespace {

// w <- (w (1 - decay) - alpha d) * s, in fp32 for a low-precision w.
void update_rows(at::Tensor w, const at::Tensor& d, double decay, double alpha, double s) {
  at::Tensor x = w.scalar_type() == at::kFloat ? w : w.to(at::kFloat);
  if (decay != 0.0) x.mul_(1.0 - decay);
  x.sub_(d, alpha);
  if (s != 1.0) x.mul_(s);
  if (!x.is_same(w)) w.copy_(x);
}

}  // namespace

void Muon::apply_normalised(std::vector<MuonPiece>& pieces, const std::vector<MuonOptions>& options,
                            const std::vector<int64_t>& grad_ranks) {
  at::NoGradGuard no_grad;
  const auto& mats = layout_.matrices();
  const size_t M = muon_.size();
  const bool normuon = config_.normuon;
  const auto blocks = [&](const MuonMatrix& m) {
    return std::max<int64_t>(1, static_cast<int64_t>(m.col_blocks.size()));
  };
  // Slots, the same on every rank: [k] |W_k|^2 per parameter; then per block
  // (matrix j, column block b) from unit[j] + 3 b: |O|^2, |N|^2, <W, N>.
  std::vector<size_t> unit(mats.size());
  size_t n = M;
  for (size_t j = 0; j < mats.size(); ++j) {
    unit[j] = n;
    n += 3 * static_cast<size_t>(blocks(mats[j]));
  }
  std::vector<char> cut(n, 0);
  std::vector<char> param_cut(M, 0);
  for (size_t k = 0; k < M; ++k) {
    param_cut[k] = layout_.world() > 1 && grad_ranks[k] != 0 &&
                   (options[k].hyperball || normuon) &&
                   cut_across_ranks(layout_.shards()[k], layout_.replicated(k));
    cut[k] = param_cut[k] && options[k].hyperball;
  }
  for (size_t j = 0; j < mats.size(); ++j) {  // (only the sums the step reads travel)
    const size_t k = mats[j].param;
    for (int64_t b = 0; b < blocks(mats[j]); ++b) {
      cut[unit[j] + 3 * b] = param_cut[k] && normuon;
      cut[unit[j] + 3 * b + 1] = param_cut[k];
      cut[unit[j] + 3 * b + 2] = param_cut[k] && options[k].hyperball;
    }
  }
  // 1. NorMuon's rows (v updated: the gate has agreed), and the local sums.
  std::vector<at::Tensor> parts;
  std::vector<size_t> part_slot;
  const auto add = [&](size_t slot, at::Tensor t) {
    parts.push_back(std::move(t));
    part_slot.push_back(slot);
  };
  for (MuonPiece& pc : pieces) {
    const MuonMatrix& m = mats[pc.matrix];
    const size_t k = m.param, i = muon_[k];
    const MuonOptions& h = options[k];
    const int64_t nb = blocks(m), rows = pc.o.size(0);
    at::Tensor v;  // this piece's rows of v, [rows, nb]
    if (normuon) {
      const ParamShard& p = params_[i];
      const int64_t first = (m.offset / m.cols + pc.row0 - p.row_begin * p.row_len / m.cols) * nb;
      v = normuon_v_[i].narrow(0, first, rows * nb).view({rows, nb});
    }
    if (h.hyperball) add(k, sum_of_products(pc.w, pc.w));
    int64_t c0 = 0;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t w = m.col_blocks.empty() ? m.cols : m.col_blocks[b];
      at::Tensor ob = pc.o.narrow(1, c0, w);
      const size_t slot = unit[pc.matrix] + 3 * b;
      if (normuon) {
        add(slot, sum_of_products(ob, ob));
        at::Tensor vb = v.select(1, b);
        vb.lerp_(ob.square().mean(1), 1.0 - h.normuon_beta2);
        ob.div_((vb.sqrt() + h.normuon_eps).unsqueeze(1));
      }
      add(slot + 1, sum_of_products(ob, ob));
      if (h.hyperball) add(slot + 2, sum_of_products(pc.w.narrow(1, c0, w), ob));
      c0 += w;
    }
  }
  std::vector<double> sums(n, 0.0);
  if (!parts.empty()) {
    const at::Tensor all = at::stack(parts).cpu();
    const double* a = all.data_ptr<double>();
    for (size_t q = 0; q < part_slot.size(); ++q) sums[part_slot[q]] += a[q];
  }
  // 2. The cut parameters' sums across the ranks: one all-reduce.
  normalise_bytes_ = sum_cut_slots(layout_.world() > 1 ? comm_.get() : nullptr, &sums, cut);
  // 3. Per block, NorMuon's rescale c = |O| / max(|N|, 1e-8) (d = c N); per
  // Hyperball parameter, |d|^2 and <W, d> from the blocks', then its step.
  const auto rescale = [&](size_t j, int64_t b) {
    if (!normuon) return 1.0;
    const double* s = &sums[unit[j] + 3 * b];
    return std::sqrt(s[0]) / std::max(std::sqrt(s[1]), 1e-8);
  };
  std::vector<HyperballScale> ball(M);
  std::vector<std::pair<double, double>> wd_dd(M, {0.0, 0.0});  // <W, d>, |d|^2
  for (size_t j = 0; j < mats.size(); ++j) {
    const size_t k = mats[j].param;
    if (!options[k].hyperball) continue;
    for (int64_t b = 0; b < blocks(mats[j]); ++b) {
      const double c = rescale(j, b);
      wd_dd[k].first += c * sums[unit[j] + 3 * b + 2];
      wd_dd[k].second += c * c * sums[unit[j] + 3 * b + 1];
    }
  }
  for (size_t k = 0; k < M; ++k) {
    const size_t i = muon_[k];
    const MuonOptions& h = options[k];
    // (a rank without rows of it has no sums: its radius stays as it is)
    if (!h.hyperball || grad_ranks[k] == 0 || params_[i].rows() == 0) continue;
    double radius = h.hyperball_radius;
    if (radius == 0.0) {
      radius = radius_[i].item<double>();
      if (radius == 0.0) radius = std::sqrt(sums[k]);  // the first step: its norm now
    }
    radius_[i].fill_(radius);
    ball[k] = hyperball_scale(h.lr, radius, sums[k], wd_dd[k].first, wd_dd[k].second);
  }
  // 4. The update: W <- s (W - a c N) (Hyperball), or W (1 - lr wd) - lr c N.
  for (MuonPiece& pc : pieces) {
    const MuonMatrix& m = mats[pc.matrix];
    const MuonOptions& h = options[m.param];
    int64_t c0 = 0;
    for (int64_t b = 0; b < blocks(m); ++b) {
      const int64_t w = m.col_blocks.empty() ? m.cols : m.col_blocks[b];
      const double c = rescale(pc.matrix, b);
      at::Tensor wb = pc.w.narrow(1, c0, w);
      const at::Tensor ob = pc.o.narrow(1, c0, w);
      if (h.hyperball) {
        update_rows(wb, ob, 0.0, ball[m.param].a * c, ball[m.param].s);
      } else {
        update_rows(wb, ob, h.lr * h.weight_decay, h.lr * c, 1.0);
      }
      c0 += w;
    }
  }
}

}  // namespace rfsdp
