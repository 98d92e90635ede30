#include "optimizers/muon/step.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

namespace rfsdp {

namespace {

// Newton–Schulz of a matrix's column blocks, each alone (batch_same_shape and
// equal widths: one batched product chain), put side by side again.
at::Tensor newton_schulz_by_columns(const at::Tensor& x, const MuonMatrix& m, int steps,
                                    const NsRun& ns) {
  const auto& w = m.col_blocks;
  const bool equal = std::all_of(w.begin(), w.end(), [&](int64_t c) { return c == w[0]; });
  if (ns.batch_same_shape && equal) {
    const int64_t nb = static_cast<int64_t>(w.size());
    const at::Tensor blocks = x.reshape({m.rows, nb, w[0]}).permute({1, 0, 2});  // [nb, rows, w]
    return newton_schulz_in_dtype(blocks, steps, ns.dtype, ns.coefficients)
        .permute({1, 0, 2})
        .reshape({m.rows, m.cols});
  }
  std::vector<at::Tensor> parts;
  int64_t c0 = 0;
  for (int64_t c : w) {
    parts.push_back(newton_schulz_in_dtype(x.narrow(1, c0, c), steps, ns.dtype, ns.coefficients));
    c0 += c;
  }
  return at::cat(parts, 1);
}

// Matrix m as the exchange moves it (flat: its column parts one after another,
// see MuonMatrix::col_parts) and back: the [rows, cols] matrix.
at::Tensor matrix_of(const MuonMatrix& m, const at::Tensor& flat) {
  if (m.col_parts == 1) return flat.view({m.rows, m.cols});
  return flat.view({m.col_parts, m.rows, m.cols / m.col_parts}).permute({1, 0, 2})
      .reshape({m.rows, m.cols});
}
at::Tensor flat_of(const MuonMatrix& m, const at::Tensor& matrix) {
  if (m.col_parts == 1) return matrix.reshape(-1);
  return matrix.reshape({m.rows, m.col_parts, m.cols / m.col_parts}).permute({1, 0, 2})
      .reshape(-1);
}

// Newton–Schulz of the matrices rooted here, in place in `own` ((matrix, update)
// pairs): one matrix at a time, or (batch_same_shape) one batched product chain
// per group of equal shape and steps (expert stacks, layers). Each result must
// be finite: the gate checks them with the gradients' check (one host wait).
void orthogonalise(const MuonLayout& layout, std::vector<std::pair<size_t, at::Tensor>>* own,
                   const NsRun& ns, StepGate* gate) {
  const auto& mats = layout.matrices();
  std::map<std::tuple<int64_t, int64_t, int>, std::vector<size_t>> batches;  // -> indices in own
  const auto left_out = [&](const MuonMatrix& mat) {
    return ns.skip_for_test != nullptr && (*ns.skip_for_test)[mat.param] != 0;
  };
  for (size_t j = 0; j < own->size(); ++j) {
    const MuonMatrix& mat = mats[(*own)[j].first];
    const int steps = layout.ns_steps(mat.param);
    if (left_out(mat)) continue;
    if (!mat.col_blocks.empty()) {
      (*own)[j].second = newton_schulz_by_columns((*own)[j].second, mat, steps, ns);
    } else if (ns.batch_same_shape) {
      batches[{mat.rows, mat.cols, steps}].push_back(j);
    } else {
      (*own)[j].second = newton_schulz_in_dtype((*own)[j].second, steps, ns.dtype, ns.coefficients);
    }
  }
  for (const auto& [key, js] : batches) {
    if (js.size() == 1) {  // alone: the plain matrix path
      (*own)[js[0]].second =
          newton_schulz_in_dtype((*own)[js[0]].second, std::get<2>(key), ns.dtype, ns.coefficients);
      continue;
    }
    std::vector<at::Tensor> batch;
    for (size_t j : js) batch.push_back((*own)[j].second);
    const at::Tensor o =
        newton_schulz_in_dtype(at::stack(batch), std::get<2>(key), ns.dtype, ns.coefficients);
    for (size_t b = 0; b < js.size(); ++b) (*own)[js[b]].second = o[b];
  }
  std::vector<int> index(mats.size());  // each matrix's index within its parameter
  std::map<size_t, int> seen;
  for (size_t k = 0; k < mats.size(); ++k) index[k] = seen[mats[k].param]++;
  for (const auto& [k, o] : *own) {
    const MuonMatrix& mat = mats[k];
    if (left_out(mat)) continue;
    if (ns.orthogonalised != nullptr) ++(*ns.orthogonalised)[k];
    gate->expect_finite(o, "the Newton-Schulz result of matrix " + std::to_string(index[k]) +
                               " of '" + layout.shards()[mat.param].name + "' (" + std::to_string(mat.rows) +
                               " x " + std::to_string(mat.cols) +
                               ") is not finite: its update holds NaN or Inf, or overflowed "
                               "(check the gradients and the momentum)",
                       /*derived=*/true);
  }
}

}  // namespace

void muon_step_from_updates(Comm* comm, const MuonLayout& layout, const NsRun& ns,
                            const std::vector<MuonOptions>& options,
                            const std::vector<at::Tensor>& params, std::vector<at::Tensor>& u,
                            const std::function<void(size_t)>& make_update, StepGate& gate,
                            const std::function<void()>& commit,
                            const std::vector<int64_t>* grad_ranks,
                            const std::function<void(std::vector<MuonPiece>&)>* finish) {
  at::NoGradGuard no_grad;
  const size_t P = layout.shards().size();
  const auto& mats = layout.matrices();
  const OwnerExchange& ex = layout.exchange();
  Comm* group = comm && layout.world() > 1 ? comm : nullptr;
  const auto direct = [&](size_t k) {
    return ex.held_whole_here(k) && !mats[k].replicated && mats[k].col_parts == 1;
  };
  // Matrix m's elements in `flat`, a flat tensor of its parameter's rows here (m held whole here).
  const auto region = [&](const MuonMatrix& m, const at::Tensor& flat) {
    const TensorShard& s = layout.shards()[m.param];
    return flat.view(-1).narrow(0, m.offset - s.row_begin * s.row_len, m.rows * m.cols);
  };
  std::vector<std::pair<size_t, at::Tensor>> own;  // (matrix, orthogonalised) rooted here
  // 1. A parameter whose every matrix is held whole here (one process; blocks the
  // plan keeps whole) needs no exchange: its update, then its Newton–Schulz,
  // parameter by parameter, so that each reads what the last just wrote, in
  // cache. (Batched Newton–Schulz wants every update first: the gather path.)
  std::vector<char> ahead(P, 0);
  if (!ns.batch_same_shape) {
    for (size_t k = 0; k < mats.size(); ++k) ahead[mats[k].param] = 1;
    for (size_t k = 0; k < mats.size(); ++k) {
      if (!direct(k)) ahead[mats[k].param] = 0;
    }
  }
  // (one process: a parameter without a gradient is known here already, and skipped
  // before its update and Newton–Schulz; across ranks the gate's count decides)
  const auto skipped_here = [&](size_t i) {
    return group == nullptr && grad_ranks != nullptr && (*grad_ranks)[i] == 0;
  };
  for (size_t i = 0; i < P; ++i) {
    if (!ahead[i] || skipped_here(i)) continue;
    make_update(i);
    if (gate.failed()) continue;
    std::vector<std::pair<size_t, at::Tensor>> mine;
    for (size_t k = 0; k < mats.size(); ++k) {
      if (mats[k].param == i) mine.emplace_back(k, region(mats[k], u[i]).view({mats[k].rows, mats[k].cols}));
    }
    gate.guard([&] { orthogonalise(layout, &mine, ns, &gate); });
    own.insert(own.end(), mine.begin(), mine.end());
    if (!gate.failed()) u[i] = at::Tensor();  // (read by nothing now: memory back for the next)
  }
  // 2. Gather: every other matrix rooted here, whole (one all-to-all).
  for (size_t i = 0; i < P; ++i) {
    if (!ahead[i]) make_update(i);
  }
  std::vector<at::Tensor> flat(P);
  for (size_t i = 0; i < P; ++i) {
    if (!ahead[i]) flat[i] = u[i].view(-1);
  }
  const std::vector<at::Tensor> whole = ex.gather(group, {flat}, /*views=*/true);
  std::vector<std::pair<size_t, at::Tensor>> gathered;
  for (size_t k = 0; k < mats.size(); ++k) {
    if (ex.owns(k) && !ahead[mats[k].param]) {
      gathered.emplace_back(k, matrix_of(mats[k], whole[k][0]));
    }
  }
  // 3. Newton–Schulz (its failures, and a result that is not finite, agreed by
  // every rank with the caller's checks before anything changes).
  if (!gate.failed()) {
    gate.guard([&] { orthogonalise(layout, &gathered, ns, &gate); });
  }
  own.insert(own.end(), gathered.begin(), gathered.end());
  // Every matrix rooted here ran Newton–Schulz, or its update would be the raw momentum
  // (plain SGD with momentum, without a word: DeepSpeed #8441): a failure every rank agrees.
  if (ns.orthogonalised != nullptr && !gate.failed()) {
    for (size_t k = 0; k < mats.size(); ++k) {
      const MuonMatrix& m = mats[k];
      if (!ex.owns(k) || skipped_here(m.param) || (*ns.orthogonalised)[k] > 0) continue;
      gate.fail("no Newton-Schulz ran for a " + std::to_string(m.rows) + " x " +
                std::to_string(m.cols) + " matrix of Muon parameter '" +
                layout.shards()[m.param].name + "', rooted on this rank: its update would be the "
                "raw momentum (plain SGD with momentum, the silent failure of DeepSpeed #8441)");
      break;
    }
  }
  gate.agree();
  commit();
  // 4. p <- p (1 - lr wd) - (lr scale) o, every matrix by the same arithmetic
  // (torch.optim.Muon's): one held whole here (not replicated) where it lies, o
  // as Newton-Schulz left it (no copies); the others' pieces back through the
  // scatter (one all-to-all), each added with its own matrix's scale.
  // (The decay p *= 1 - lr wd goes region by region just before its add: the
  // matrices tile every parameter, so each element is decayed once, while in cache.)
  const auto decayed = [&](const MuonMatrix& m, at::Tensor region) {
    const MuonOptions& h = options[m.param];
    return h.weight_decay != 0.0 ? region.mul_(1.0 - h.lr * h.weight_decay) : region;
  };
  // A matrix of column blocks has each block's scale folded into o on its root
  // (one alpha for the matrix's pieces wherever they go).
  const auto alpha = [&](const MuonMatrix& m) {
    const double scale =
        m.col_blocks.empty() ? muon_update_scale(m.rows, m.cols, options[m.param].adjust_lr) : 1.0;
    return -options[m.param].lr * scale;
  };
  const auto scaled = [&](const MuonMatrix& m, at::Tensor o_mat) {
    if (m.col_blocks.empty()) return o_mat;
    o_mat = o_mat.to(at::kFloat);
    int64_t c0 = 0;
    for (int64_t c : m.col_blocks) {
      o_mat.narrow(1, c0, c).mul_(muon_update_scale(m.rows, c, options[m.param].adjust_lr));
      c0 += c;
    }
    return o_mat;
  };
  const auto skipped = [&](const MuonMatrix& m) {
    return grad_ranks != nullptr && (*grad_ranks)[m.param] == 0;
  };
  std::vector<at::Tensor> results(mats.size()), o(P);
  std::vector<MuonPiece> pieces;  // (finish: every matrix's rows here, scaled)
  // o_mat's rows [r0, r0 + n) of matrix k with adjust_lr's scale in it, fp32.
  const auto piece = [&](size_t k, at::Tensor o_rows, int64_t r0, at::Tensor w_rows) {
    const MuonMatrix& m = mats[k];
    at::Tensor x = o_rows.to(at::kFloat);
    if (m.col_blocks.empty()) x = x.mul(muon_update_scale(m.rows, m.cols, options[m.param].adjust_lr));
    pieces.push_back({k, r0, x.contiguous(), w_rows});
  };
  for (auto& [k, o_mat] : own) {
    const MuonMatrix& mat = mats[k];
    if (!direct(k)) {
      results[k] = flat_of(mat, scaled(mat, o_mat).to(at::kFloat));
      continue;
    }
    if (skipped(mat)) continue;
    if (finish) {
      piece(k, scaled(mat, o_mat), 0, region(mat, params[mat.param]).view({mat.rows, mat.cols}));
      continue;
    }
    decayed(mat, region(mat, params[mat.param])).view({mat.rows, mat.cols})
        .add_(scaled(mat, o_mat), alpha(mat));
  }
  for (size_t k = 0; k < mats.size(); ++k) {
    if (!direct(k) && !o[mats[k].param].defined()) o[mats[k].param] = at::empty_like(flat[mats[k].param]);
  }
  ex.scatter(group, results, {o});
  for (size_t k = 0; k < mats.size(); ++k) {  // this rank's rows of each scattered matrix
    const MuonMatrix& mat = mats[k];
    if (direct(k) || skipped(mat)) continue;
    const TensorShard& s = layout.shards()[mat.param];
    const int64_t e0 = s.row_begin * s.row_len, e1 = s.row_end * s.row_len;
    const int64_t b = std::max(mat.offset, e0), e = std::min(mat.offset + mat.rows * mat.cols, e1);
    if (e > b && finish) {
      if ((b - mat.offset) % mat.cols != 0 || (e - b) % mat.cols != 0) {  // (rows of cols elements)
        throw std::logic_error("Muon: a shard of '" + s.name + "' cuts a row of its matrices, "
                               "which NorMuon and Hyperball take whole");
      }
      const int64_t n = (e - b) / mat.cols;
      piece(k, o[mat.param].narrow(0, b - e0, e - b).view({n, mat.cols}), (b - mat.offset) / mat.cols,
            params[mat.param].view(-1).narrow(0, b - e0, e - b).view({n, mat.cols}));
    } else if (e > b) {
      decayed(mat, params[mat.param].view(-1).narrow(0, b - e0, e - b))
          .add_(o[mat.param].narrow(0, b - e0, e - b), alpha(mat));
    }
  }
  if (finish) (*finish)(pieces);
}

}  // namespace rfsdp
