#include "optimizers/common/hyperball.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

namespace rfsdp {

bool cut_across_ranks(const TensorShard& shard, bool replicated) {
  if (replicated) return false;
  int holders = 0;
  bool all_whole = true;  // (every holder holds it whole: a DDP replica)
  for (const auto& [b, e] : shard.rank_rows) {
    if (e <= b) continue;
    ++holders;
    all_whole = all_whole && b == 0 && e == shard.full_rows;
  }
  return holders > 1 && !all_whole;
}

int first_holder(const TensorShard& shard) {  // (a replica's: rank 0)
  for (size_t r = 0; r < shard.rank_rows.size(); ++r) {
    if (shard.rank_rows[r].second > shard.rank_rows[r].first) return static_cast<int>(r);
  }
  return 0;
}

int64_t sum_cut_slots(Comm* comm, std::vector<double>* sums, const std::vector<char>& cut) {
  std::vector<size_t> slots;
  for (size_t j = 0; j < cut.size(); ++j) {
    if (cut[j]) slots.push_back(j);
  }
  if (slots.empty() || comm == nullptr || comm->size() == 1) return 0;
  at::Tensor t = at::empty({static_cast<int64_t>(slots.size())}, at::kDouble);
  double* p = t.data_ptr<double>();
  for (size_t j = 0; j < slots.size(); ++j) p[j] = (*sums)[slots[j]];
  t = t.to(comm->control_device());
  comm->all_reduce(t, ReduceOp::Sum).wait();
  t = t.cpu();
  p = t.data_ptr<double>();
  for (size_t j = 0; j < slots.size(); ++j) (*sums)[slots[j]] = p[j];
  return static_cast<int64_t>(slots.size() * sizeof(double));
}

at::Tensor sum_of_products(const at::Tensor& a, const at::Tensor& b) {
  const auto fp32 = [](const at::Tensor& t) { return t.scalar_type() == at::kFloat ? t : t.to(at::kFloat); };
  const at::Tensor x = fp32(a);
  return (x.is_same(b) ? x.square() : x * fp32(b)).sum(at::kDouble);
}

HyperballScale hyperball_scale(double lr, double radius, double ww, double wd, double dd) {
  HyperballScale h;
  h.a = lr * radius / (std::sqrt(std::max(dd, 0.0)) + 1e-8);
  const double moved = std::max(ww - 2.0 * h.a * wd + h.a * h.a * dd, 0.0);
  h.s = radius / (std::sqrt(moved) + 1e-8);
  return h;
}

}  // namespace rfsdp
