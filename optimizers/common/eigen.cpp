#include "optimizers/common/eigen.h"

#include <algorithm>
#include <limits>
#include <stdexcept>

namespace rfsdp {

std::pair<at::Tensor, at::Tensor> eigh_in_fp64(const at::Tensor& a) {
  const auto [l, q] = at::linalg_eigh(a.to(at::kDouble));
  return {l.to(at::kFloat), q.to(at::kFloat)};
}

std::vector<bool> eigh_with_retry(const std::vector<at::Tensor>& a, const EighAccept& accept,
                                  int64_t* retries) {
  const size_t n = a.size();
  std::vector<bool> ok(n, false);
  if (n == 0) return ok;
  auto single = [&](size_t k, at::ScalarType dt) -> bool {
    try {
      auto [l, q] = at::linalg_eigh(a[k].to(dt));
      return accept({k}, l.unsqueeze(0), q.unsqueeze(0))[0];
    } catch (const c10::Error&) {
      return false;  // no convergence
    }
  };
  bool batched = false;
  try {
    auto [l, q] = at::linalg_eigh(at::stack(a).to(at::kFloat));
    batched = true;
    std::vector<size_t> all(n);
    for (size_t k = 0; k < n; ++k) all[k] = k;
    ok = accept(all, l, q);
  } catch (const c10::Error&) {
    // Some matrix did not converge: each is tried alone below.
  }
  for (size_t k = 0; k < n; ++k) {
    if (ok[k]) continue;
    if (!batched && single(k, at::kFloat)) {
      ok[k] = true;
      continue;
    }
    if (retries) ++*retries;
    ok[k] = single(k, at::kDouble);
  }
  return ok;
}

RankDeficient parse_rank_deficient(const std::string& s) {
  if (s == "shift") return RankDeficient::Shift;
  if (s == "pseudo_inverse") return RankDeficient::PseudoInverse;
  if (s == "strict") return RankDeficient::Strict;
  throw std::invalid_argument("Shampoo: rank_deficient must be \"shift\", \"pseudo_inverse\" or "
                              "\"strict\", got \"" + s + "\"");
}

const char* to_string(RankDeficient r) {
  switch (r) {
    case RankDeficient::Shift: return "shift";
    case RankDeficient::PseudoInverse: return "pseudo_inverse";
    case RankDeficient::Strict: return "strict";
  }
  return "?";
}

std::vector<at::Tensor> inverse_fourth_roots(const std::vector<at::Tensor>& a,
                                             std::vector<bool>* ok, int64_t* retries,
                                             const RootRule& rule,
                                             std::vector<std::pair<at::Tensor, at::Tensor>>* eigen) {
  const size_t n = a.size();
  if (rule.mode == RankDeficient::Shift && rule.floors.size() != n) {
    throw std::invalid_argument("inverse_fourth_roots: the shift rule needs one floor per matrix");
  }
  std::vector<at::Tensor> out(n);
  if (eigen) eigen->assign(n, {});
  // One eigendecomposition A = Q diag(l) Q^T gives A^-1/4 = Q diag(s) Q^T, with
  // s = l^-1/4 for the eigenvalues the rule keeps (after its shift) and 0 for those
  // it drops; a failure where l or the root is not finite, or (Strict) l <= 0.
  auto root = [&](size_t k, at::Tensor l, const at::Tensor& q) {
    if (!at::isfinite(l).all().item<bool>()) return false;
    at::Tensor s;
    if (rule.mode == RankDeficient::PseudoInverse) {
      const double rtol = rule.rtol >= 0 ? rule.rtol
                                         : static_cast<double>(l.size(-1)) *
                                               std::numeric_limits<float>::epsilon();
      const double cut = std::max(0.0, rtol * l.max().item<double>());
      const at::Tensor keep = l > cut;
      s = at::where(keep, at::where(keep, l, at::ones_like(l)).pow(-0.25), at::zeros_like(l));
    } else {
      if (rule.mode == RankDeficient::Shift) {
        const double lo = l.min().item<double>();
        if (lo < rule.floors[k]) l = l - lo + rule.floors[k];
      }
      if (!(l > 0).all().item<bool>()) return false;
      s = l.pow(-0.25);
    }
    const at::Tensor r = at::matmul(q * s.unsqueeze(-2), q.transpose(-1, -2));
    if (!at::isfinite(r).all().item<bool>()) return false;
    out[k] = r.to(at::kFloat);
    if (eigen) (*eigen)[k] = {q.to(at::kFloat), s.to(at::kFloat)};
    return true;
  };
  *ok = eigh_with_retry(
      a,
      [&](const std::vector<size_t>& ks, const at::Tensor& l, const at::Tensor& q) {
        std::vector<bool> took(ks.size());
        for (size_t j = 0; j < ks.size(); ++j) took[j] = root(ks[j], l[j], q[j]);
        return took;
      },
      retries);
  return out;
}

std::vector<at::Tensor> descending_eigenvectors(const std::vector<at::Tensor>& a,
                                                std::vector<bool>* ok, int64_t* retries) {
  std::vector<at::Tensor> out(a.size());
  *ok = eigh_with_retry(
      a,
      [&](const std::vector<size_t>& ks, const at::Tensor&, const at::Tensor& q) {
        // Which of the batch are finite, on the host: one wait per batch.
        const at::Tensor fin = at::isfinite(q).flatten(1).all(1).to(at::kCPU).contiguous();
        std::vector<bool> took(ks.size(), false);
        for (size_t j = 0; j < ks.size(); ++j) {
          if (!fin.data_ptr<bool>()[j]) continue;
          out[ks[j]] = q[j].flip({-1}).to(at::kFloat).contiguous();  // eigh: ascending
          took[j] = true;
        }
        return took;
      },
      retries);
  return out;
}

BasisRefresh refresh_bases(const at::Tensor& x, const at::Tensor& q) {
  const int64_t d = x.size(-1);
  // diag(Q^T X Q), column c: sum over r of Q[r, c] (X Q)[r, c].
  const at::Tensor est = (q * at::bmm(x, q)).sum(1);
  BasisRefresh out;
  out.order = at::argsort(est, /*stable=*/true, /*dim=*/1, /*descending=*/true);
  const at::Tensor sorted = at::gather(q, 2, out.order.unsqueeze(1).expand({-1, d, -1}));
  out.q = std::get<0>(at::linalg_qr(at::bmm(x, sorted)));
  const at::Tensor fin = at::isfinite(out.q).flatten(1).all(1).to(at::kCPU).contiguous();
  for (int64_t k = 0; k < fin.numel(); ++k) out.finite.push_back(fin.data_ptr<bool>()[k]);
  return out;
}

}  // namespace rfsdp
