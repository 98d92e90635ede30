#include "optimizers/shampoo/shampoo.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <mutex>
#include <stdexcept>
#include <tuple>

#include "optimizers/common/finite.h"
#include "optimizers/common/matrices.h"

namespace rfsdp {

namespace {

void check_options(const ShampooOptions& o) {
  if (!(o.lr >= 0) || o.beta1 < 0 || o.beta1 >= 1 || o.beta2 < 0 || o.beta2 > 1 ||
      !(o.epsilon >= 0) || o.grafting_beta2 < 0 || o.grafting_beta2 >= 1 ||
      !(o.grafting_epsilon > 0) || !(o.weight_decay >= 0)) {
    throw std::invalid_argument(
        "Shampoo: need lr >= 0, 0 <= beta1 < 1, 0 <= beta2 <= 1, epsilon >= 0, "
        "0 <= grafting_beta2 < 1, grafting_epsilon > 0, weight_decay >= 0");
  }
}

void check_config(const ShampooConfig& c) {
  if (c.max_preconditioner_dim < 1) {
    throw std::invalid_argument("Shampoo: max_preconditioner_dim must be >= 1");
  }
  if (c.precondition_frequency < 1) {
    throw std::invalid_argument("Shampoo: precondition_frequency must be >= 1");
  }
  if (c.start_preconditioning_step < c.precondition_frequency) {
    throw std::invalid_argument(
        "Shampoo: start_preconditioning_step (" + std::to_string(c.start_preconditioning_step) +
        ") must be >= precondition_frequency (" + std::to_string(c.precondition_frequency) +
        "), so that the roots exist when preconditioning starts");
  }
  if (c.factor_dtype != at::kFloat && c.factor_dtype != at::kBFloat16) {
    throw std::invalid_argument("Shampoo: factor_dtype must be float32 or bfloat16");
  }
}

// A tile of a flat tensor: rows x cols, rows `stride` apart (a view).
at::Tensor tile_of(const at::Tensor& flat, const ShampooTile& t) {
  return flat.as_strided({t.rows, t.cols}, {t.stride, 1}, flat.storage_offset() + t.local_offset);
}

std::string tile_name(const ParamShard& p, const ShampooTile& t) {
  return "parameter '" + p.name + "' tile of matrix " + std::to_string(t.matrix) + " rows [" +
         std::to_string(t.row0) + ", " + std::to_string(t.row0 + t.rows) + ") columns [" +
         std::to_string(t.col0) + ", " + std::to_string(t.col0 + t.cols) + ")";
}

// On a GPU: the flat positions of an n x n matrix's upper triangle, row by row
// (the packed order), and of their mirror images; made once per size and device.
struct TriangleIndex {
  at::Tensor upper, lower;  // int64 [n (n + 1) / 2]
};
const TriangleIndex& triangle_index(int64_t n, const at::Device& device) {
  static std::mutex mu;
  static std::map<std::tuple<int64_t, int, int>, TriangleIndex> cache;
  std::lock_guard<std::mutex> lock(mu);
  TriangleIndex& t = cache[{n, static_cast<int>(device.type()), static_cast<int>(device.index())}];
  if (!t.upper.defined()) {
    const at::Tensor ij = at::triu_indices(n, n, 0, at::TensorOptions(at::kLong).device(device));
    t.upper = ij[0] * n + ij[1];
    t.lower = ij[1] * n + ij[0];
  }
  return t;
}

}  // namespace

int64_t shampoo_granule_rows(const std::vector<int64_t>& shape, int row_dims, int64_t max_dim) {
  if (shape.size() <= 1) return 1;  // not preconditioned: any boundary
  if (shape.size() == 3 && row_dims == 2) {  // E*H rows: tiles of B rows inside each expert
    return shape[1] % max_dim == 0 ? max_dim : shape[1];
  }
  if (shape.size() == 3 && row_dims == 1) return 1;  // a row is a whole expert
  if (row_dims == 1) return max_dim;                 // bands of B rows of dim 0
  throw std::invalid_argument("Shampoo: rows of " + std::to_string(row_dims) +
                              " dims of a " + std::to_string(shape.size()) +
                              "-D tensor are not supported (use row_dims 1, or 2 for [E, H, I])");
}

std::vector<ShampooTile> shampoo_tiles(const ParamShard& p, size_t param, int64_t max_dim) {
  std::vector<ShampooTile> out;
  const int64_t e0 = p.row_begin * p.row_len, e1 = e0 + p.param.numel();
  int64_t left = 0, right = 0;
  const auto mats = matrices_of(p.shape);
  for (size_t k = 0; k < mats.size(); ++k) {
    const MatrixView& m = mats[k];
    for (int64_t r0 = 0; r0 < m.rows; r0 += max_dim) {
      const int64_t rows = std::min(max_dim, m.rows - r0);
      const int64_t lo = m.offset + r0 * m.cols, hi = lo + rows * m.cols;
      if (hi <= e0 || lo >= e1 || m.cols == 0) continue;  // another rank's
      if (lo < e0 || hi > e1) {
        throw std::invalid_argument(
            "Shampoo: parameter '" + p.name + "': this shard holds elements [" +
            std::to_string(e0) + ", " + std::to_string(e1) + "), which cut the tile rows [" +
            std::to_string(r0) + ", " + std::to_string(r0 + rows) + ") of matrix " +
            std::to_string(k) + "; plan the unit with the Shampoo granule "
            "(rfsdp.policy.shampoo(max_preconditioner_dim=" + std::to_string(max_dim) +
            ") in Python) so every tile lies on one rank");
      }
      for (int64_t c0 = 0; c0 < m.cols; c0 += max_dim) {
        const int64_t cols = std::min(max_dim, m.cols - c0);
        out.push_back({param, static_cast<int64_t>(k), r0, rows, c0, cols, lo - e0 + c0, m.cols,
                       left, right});
        left += shampoo_packed_size(rows);
        right += shampoo_packed_size(cols);
      }
    }
  }
  return out;
}

std::vector<at::Tensor> inverse_fourth_roots(const std::vector<at::Tensor>& a,
                                             std::vector<bool>* ok, int64_t* retries,
                                             const std::vector<double>& floors) {
  const size_t n = a.size();
  if (!floors.empty() && floors.size() != n) {
    throw std::invalid_argument("inverse_fourth_roots: one floor per matrix");
  }
  std::vector<at::Tensor> out(n);
  ok->assign(n, false);
  if (n == 0) return out;
  // One eigendecomposition: A = Q diag(l) Q^T; A^-1/4 = Q diag(l^-1/4) Q^T when
  // every l is finite and positive (after the floor, if any) and the root finite.
  auto root = [&](size_t k, at::Tensor l, const at::Tensor& q, at::Tensor* r) {
    if (!at::isfinite(l).all().item<bool>()) return false;
    if (!floors.empty()) {
      const double lo = l.min().item<double>();
      if (lo < floors[k]) l = l - lo + floors[k];
    }
    if (!(l > 0).all().item<bool>()) return false;
    *r = at::matmul(q * l.pow(-0.25).unsqueeze(-2), q.transpose(-1, -2));
    return static_cast<bool>(at::isfinite(*r).all().item<bool>());
  };
  auto single = [&](size_t k, at::ScalarType dt, at::Tensor* r) {
    try {
      auto [l, q] = at::linalg_eigh(a[k].to(dt));
      return root(k, l, q, r);
    } catch (const c10::Error&) {
      return false;  // no convergence
    }
  };
  std::vector<bool> batch_tried(n, false);
  try {
    auto [l, q] = at::linalg_eigh(at::stack(a).to(at::kFloat));
    for (size_t k = 0; k < n; ++k) {
      at::Tensor r;
      batch_tried[k] = true;
      if (root(k, l[k], q[k], &r)) out[k] = r, (*ok)[k] = true;
    }
  } catch (const c10::Error&) {
    // Some matrix did not converge: each is tried alone below.
  }
  for (size_t k = 0; k < n; ++k) {
    if ((*ok)[k]) continue;
    at::Tensor r;
    if (!batch_tried[k] && single(k, at::kFloat, &r)) {
      out[k] = r, (*ok)[k] = true;
      continue;
    }
    if (retries) ++*retries;
    if (single(k, at::kDouble, &r)) out[k] = r.to(at::kFloat), (*ok)[k] = true;
  }
  return out;
}

Shampoo::Shampoo(std::vector<ParamShard> params, ShampooOptions options, ShampooConfig config,
                 std::shared_ptr<Comm> comm, std::vector<bool> precondition)
    : params_(std::move(params)), options_(options), config_(config), comm_(std::move(comm)) {
  check_options(options_);
  check_config(config_);
  const size_t n = params_.size();
  if (!precondition.empty() && precondition.size() != n) {
    throw std::invalid_argument("Shampoo: " + std::to_string(precondition.size()) +
                                " precondition flags for " + std::to_string(n) + " parameters");
  }
  param_options_.resize(n);
  has_param_options_.assign(n, false);
  steps_.assign(n, 0);
  const auto fdt = at::TensorOptions().dtype(config_.factor_dtype);
  for (size_t i = 0; i < n; ++i) {
    const ParamShard& p = params_[i];
    if (!p.param.defined() || p.param.scalar_type() != at::kFloat || !p.param.is_contiguous() ||
        !(p.param.device().is_cpu() || p.param.device().is_cuda())) {
      throw std::invalid_argument("Shampoo: parameter '" + p.name +
                                  "' must be a contiguous float32 tensor on the CPU or a CUDA "
                                  "device");
    }
    precondition_.push_back((precondition.empty() || precondition[i]) && p.shape.size() >= 2);
    ParamState s;
    s.m = at::zeros_like(p.param);
    s.v = at::zeros_like(p.param);
    if (precondition_[i]) {
      for (const ShampooTile& t : shampoo_tiles(p, i, config_.max_preconditioner_dim)) {
        s.tiles.push_back(tiles_.size());
        tiles_.push_back(t);
      }
      int64_t left = 0, right = 0;
      for (size_t k : s.tiles) {
        left += shampoo_packed_size(tiles_[k].rows);
        right += shampoo_packed_size(tiles_[k].cols);
      }
      const auto on = fdt.device(p.param.device());  // factors live with the shard
      s.left = at::zeros({left}, on);
      s.right = at::zeros({right}, on);
      s.root_l = at::zeros({left}, on);
      s.root_r = at::zeros({right}, on);
      for (size_t k : s.tiles) {  // roots start as the identity
        const ShampooTile& t = tiles_[k];
        s.root_l.narrow(0, t.left_offset, shampoo_packed_size(t.rows)).copy_(pack(at::eye(t.rows)));
        s.root_r.narrow(0, t.right_offset, shampoo_packed_size(t.cols)).copy_(pack(at::eye(t.cols)));
      }
      s.failures = at::zeros({static_cast<int64_t>(s.tiles.size())}, at::kLong);
    }
    state_.push_back(std::move(s));
  }
}

void Shampoo::set_param_options(size_t i, const ShampooOptions& o) {
  check_options(o);
  param_options_.at(i) = o;
  has_param_options_.at(i) = true;
}

void Shampoo::set_grad(size_t i, const at::Tensor& grad) {
  check_grad("Shampoo", params_.at(i), grad);
  params_[i].grad = grad;
}

// Row i of the upper triangle, columns [i, n), follows rows 0..i-1: plain copies
// at memory speed (an index_select/index_copy pair cost 30% of a step).
at::Tensor Shampoo::pack(const at::Tensor& full) {
  const at::Tensor f = full.to(at::kFloat).contiguous();
  const int64_t n = f.size(0);
  if (!f.is_cpu()) {  // on a GPU: one gather of the upper triangle (row by row)
    return f.view(-1).index_select(0, triangle_index(n, f.device()).upper);
  }
  at::Tensor out = at::empty({shampoo_packed_size(n)}, at::kFloat);
  const float* src = f.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    std::copy(src + i * n + i, src + (i + 1) * n, dst);
    dst += n - i;
  }
  return out;
}

at::Tensor Shampoo::unpack(const at::Tensor& flat, int64_t offset, int64_t n) {
  const at::Tensor packed = flat.narrow(0, offset, shampoo_packed_size(n)).to(at::kFloat).contiguous();
  if (!packed.is_cpu()) {  // on a GPU: two scatters (the mirror, then the upper triangle)
    const TriangleIndex& ix = triangle_index(n, packed.device());
    at::Tensor full = at::empty({n * n}, packed.options());
    full.index_put_({ix.lower}, packed);
    full.index_put_({ix.upper}, packed);
    return full.view({n, n});
  }
  at::Tensor full = at::empty({n, n}, at::kFloat);
  const float* src = packed.data_ptr<float>();
  float* dst = full.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    std::copy(src, src + (n - i), dst + i * n + i);
    src += n - i;
  }
  for (int64_t i = 1; i < n; ++i) {  // the lower triangle mirrors the upper
    for (int64_t j = 0; j < i; ++j) dst[i * n + j] = dst[j * n + i];
  }
  return full;
}

void Shampoo::update_roots(const std::vector<size_t>& due) {
  const auto t0 = std::chrono::steady_clock::now();
  // Every factor whose root is due, grouped by size: one batched eigh per size.
  struct Job {
    size_t tile;
    bool left;
  };
  std::map<int64_t, std::vector<Job>> by_size;
  std::map<int64_t, std::vector<at::Tensor>> mats;
  std::map<int64_t, std::vector<double>> floors;  // bf16 factors only (see inverse_fourth_roots)
  const bool floored = config_.factor_dtype != at::kFloat;
  for (size_t i : due) {
    const ParamState& s = state_[i];
    const ShampooOptions& o = options_of(i);
    const bool correct = config_.use_bias_correction && o.beta2 < 1;
    const double bc = correct ? 1.0 - std::pow(o.beta2, static_cast<double>(steps_[i])) : 1.0;
    for (size_t k : s.tiles) {
      const ShampooTile& t = tiles_[k];
      for (bool left : {true, false}) {
        const int64_t d = left ? t.rows : t.cols;
        at::Tensor a = unpack(left ? s.left : s.right, left ? t.left_offset : t.right_offset, d) / bc;
        a.diagonal().add_(o.epsilon);
        by_size[d].push_back({k, left});
        mats[d].push_back(a);
        if (floored) floors[d].push_back(o.epsilon);
      }
    }
  }
  std::vector<bool> failed(tiles_.size(), false);
  for (auto& [d, jobs] : by_size) {
    std::vector<bool> ok;
    const auto roots = inverse_fourth_roots(mats[d], &ok, &fp64_retries_, floors[d]);
    for (size_t j = 0; j < jobs.size(); ++j) {
      const ShampooTile& t = tiles_[jobs[j].tile];
      if (!ok[j]) {  // keep the previous root
        failed[jobs[j].tile] = true;
        continue;
      }
      ParamState& s = state_[t.param];
      (jobs[j].left ? s.root_l : s.root_r)
          .narrow(0, jobs[j].left ? t.left_offset : t.right_offset, shampoo_packed_size(d))
          .copy_(pack(roots[j]));
    }
  }
  for (size_t i : due) {
    ParamState& s = state_[i];
    for (size_t j = 0; j < s.tiles.size(); ++j) {
      int64_t& f = s.failures.data_ptr<int64_t>()[j];
      f = failed[s.tiles[j]] ? f + 1 : 0;
      if (f >= 3) {
        throw std::runtime_error("Shampoo: the inverse roots of " +
                                 tile_name(params_[i], tiles_[s.tiles[j]]) +
                                 " failed 3 times in a row in fp32 and fp64 (non-finite or "
                                 "non-positive eigenvalues): raise epsilon, or check the "
                                 "gradients");
      }
    }
  }
  root_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Shampoo::step() {
  std::vector<at::Tensor> grads;
  for (const auto& p : params_) {
    if (p.grad.defined()) grads.push_back(p.grad);
  }
  if (config_.check_finite && !all_ranks_finite(comm_.get(), grads)) {
    throw std::runtime_error("Shampoo step: a gradient on some rank holds NaN or Inf; the step "
                             "was not taken on any rank (check the loss, lower the learning "
                             "rate, or clip gradients)");
  }
  at::NoGradGuard no_grad;
  std::vector<size_t> stepped, due;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].grad.defined()) continue;
    const int64_t t = ++steps_[i];
    const ShampooOptions& o = options_of(i);
    ParamState& s = state_[i];
    const at::Tensor g = params_[i].grad.view({-1});
    s.v.view({-1}).mul_(o.grafting_beta2).addcmul_(g, g, 1.0 - o.grafting_beta2);
    s.m.view({-1}).mul_(o.beta1).add_(g, 1.0 - o.beta1);
    if (precondition_[i]) {
      const double c = o.beta2 < 1 ? 1.0 - o.beta2 : 1.0;
      for (size_t k : s.tiles) {
        const ShampooTile& tl = tiles_[k];
        const at::Tensor gt = tile_of(g, tl);
        at::Tensor l = s.left.narrow(0, tl.left_offset, shampoo_packed_size(tl.rows));
        at::Tensor r = s.right.narrow(0, tl.right_offset, shampoo_packed_size(tl.cols));
        const at::Tensor gg_l = pack(at::mm(gt, gt.t())), gg_r = pack(at::mm(gt.t(), gt));
        if (config_.factor_dtype == at::kFloat) {
          l.mul_(o.beta2).add_(gg_l, c);
          r.mul_(o.beta2).add_(gg_r, c);
        } else {  // stored in bf16, updated in fp32
          l.copy_(l.to(at::kFloat).mul_(o.beta2).add_(gg_l, c));
          r.copy_(r.to(at::kFloat).mul_(o.beta2).add_(gg_r, c));
        }
      }
      if (t % config_.precondition_frequency == 0) due.push_back(i);
    }
    stepped.push_back(i);
  }
  if (!due.empty()) update_roots(due);
  for (size_t i : stepped) {
    const int64_t t = steps_[i];
    const ShampooOptions& o = options_of(i);
    ParamState& s = state_[i];
    const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(t));
    const double bc2g = 1.0 - std::pow(o.grafting_beta2, static_cast<double>(t));
    const at::Tensor m_hat = s.m.view({-1}) / bc1;
    at::Tensor u = m_hat / ((s.v.view({-1}) / bc2g).sqrt_().add_(o.grafting_epsilon));  // D
    if (precondition_[i] && t >= config_.start_preconditioning_step) {
      for (size_t k : s.tiles) {
        const ShampooTile& tl = tiles_[k];
        at::Tensor d = tile_of(u, tl);
        const at::Tensor rl = unpack(s.root_l, tl.left_offset, tl.rows);
        const at::Tensor rr = unpack(s.root_r, tl.right_offset, tl.cols);
        at::Tensor p = at::matmul(at::matmul(rl, tile_of(m_hat, tl)), rr);
        if (p.is_cuda()) {  // the same on the device, with no host wait per tile
          const at::Tensor np = p.norm();
          d.copy_(at::where(np > 0, p * (d.norm() / np), d));
          continue;
        }
        const double np = p.norm().item<double>();
        if (np > 0) d.copy_(p.mul_(d.norm().item<double>() / np));  // else keep D
      }
    }
    params_[i].param.view({-1}).mul_(1.0 - o.lr * o.weight_decay).add_(u, -o.lr);
  }
}

std::vector<std::pair<std::string, at::Tensor>> Shampoo::state(size_t i) const {
  const ParamState& s = state_.at(i);
  std::vector<std::pair<std::string, at::Tensor>> out{{"exp_avg", s.m}, {"exp_avg_sq", s.v}};
  if (precondition_[i]) {
    out.insert(out.end(), {{"factor_left", s.left},
                           {"factor_right", s.right},
                           {"root_left", s.root_l},
                           {"root_right", s.root_r},
                           {"root_failures", s.failures}});
  }
  return out;
}

int64_t Shampoo::factor_bytes() const {
  int64_t b = 0;
  for (const auto& s : state_) {
    for (const at::Tensor* t : {&s.left, &s.right, &s.root_l, &s.root_r}) {
      if (t->defined()) b += t->nbytes();
    }
  }
  return b;
}

double Shampoo::root_flops() const {
  double f = 0;
  for (const auto& t : tiles_) f += 9.0 * (std::pow(t.rows, 3) + std::pow(t.cols, 3));
  return f;
}

}  // namespace rfsdp
