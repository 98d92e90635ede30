// The eigendecompositions of the matrix optimizers: one batched symmetric eigh
// in fp32 with each failure retried alone in fp64, Shampoo's inverse fourth
// roots under a rule for rank-deficient factors, SOAP's bases (eigenvectors by
// descending eigenvalue) and their refresh by one power step and QR. All ATen:
// they run where the factors live (a CPU or a GPU).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace rfsdp {

// Eigendecompositions A = Q diag(l) Q^T (l ascending) of symmetric matrices of
// one size: one batched eigh in fp32; every matrix that did not converge there,
// or whose result `accept` refused, is tried alone (in fp32 where the batch
// threw, then in fp64, each fp64 try counted in *retries). accept(ks, l, q)
// gets l [b, n] and q [b, n, n] for the matrices ks and says which it took.
// Returns which matrices were taken.
using EighAccept = std::function<std::vector<bool>(const std::vector<size_t>& ks, const at::Tensor& l,
                                                   const at::Tensor& q)>;
std::vector<bool> eigh_with_retry(const std::vector<at::Tensor>& a, const EighAccept& accept,
                                  int64_t* retries);

// The eigendecomposition A = Q diag(l) Q^T (l ascending) of one symmetric
// matrix computed in fp64, returned in fp32 as (l, Q): a stored inverse root
// taken apart exactly enough to be coded (Shampoo's requantisation).
std::pair<at::Tensor, at::Tensor> eigh_in_fp64(const at::Tensor& a);

// What the inverse root does with the eigenvalues l of A = L / bc + eps I, which
// are >= eps in exact arithmetic but, for a rank-deficient factor (a tile whose
// gradients span fewer than its rows: rare tokens, zero rows, low-rank
// updates), fall below eps, or below zero, by rounding (about -1e-8 l_max in
// fp32, -2^-9 l_max in bf16).
enum class RankDeficient {
  // l <- l - l_min + eps where l_min < eps: the spectrum lifted so that its
  // smallest eigenvalue is eps (DistributedShampoo's perturbation). Needs eps > 0.
  Shift,
  // l <= rank_rtol * l_max count as zero: their directions get no
  // preconditioning (a zero root there; a tile whose root is all zero takes D).
  PseudoInverse,
  // Any l <= 0 is a failure (retried in fp64): the three-failures error.
  Strict,
};
RankDeficient parse_rank_deficient(const std::string& s);  // "shift" | "pseudo_inverse" | "strict"
const char* to_string(RankDeficient r);

// How inverse_fourth_roots treats the eigenvalues (see RankDeficient):
// floors[k] is matrix k's eps (Shift), rtol PseudoInverse's threshold (< 0: n *
// eps(float32)).
struct RootRule {
  RankDeficient mode = RankDeficient::Strict;
  std::vector<double> floors;  // one per matrix (Shift)
  double rtol = -1.0;
};

// A^(-1/4) of symmetric matrices of one size (eigh_with_retry), their
// eigenvalues treated by `rule`. ok[k] is false where both failed (no
// convergence, a non-finite eigenvalue or root, or under Strict a non-positive
// eigenvalue); out[k] is then undefined. eigen given: (*eigen)[k] = (Q, s),
// fp32, with out[k] = Q diag(s) Q^T (Q's columns by ascending eigenvalue of A).
std::vector<at::Tensor> inverse_fourth_roots(const std::vector<at::Tensor>& a,
                                             std::vector<bool>* ok, int64_t* retries = nullptr,
                                             const RootRule& rule = {},
                                             std::vector<std::pair<at::Tensor, at::Tensor>>* eigen = nullptr);

// The eigenvectors of symmetric matrices of one size, columns by descending
// eigenvalue (eigh_with_retry); ok[k] false where both failed (no convergence,
// a non-finite result). One host wait per batch (its finiteness).
std::vector<at::Tensor> descending_eigenvectors(const std::vector<at::Tensor>& a,
                                                std::vector<bool>* ok, int64_t* retries);

// SOAP's basis refresh of a batch: x [b, d, d] the factors, q [b, d, d] their
// current bases. order[k] = argsort of diag(q_k^T x_k q_k), descending (stable);
// q_new[k] = qr(x_k q_k[:, order[k]]).Q; finite[k] (host) whether q_new[k] is.
struct BasisRefresh {
  at::Tensor q, order;
  std::vector<bool> finite;
};
BasisRefresh refresh_bases(const at::Tensor& x, const at::Tensor& q);

}  // namespace rfsdp
