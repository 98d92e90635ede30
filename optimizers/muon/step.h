// Muon's step over its layout: the optimizer's own (muon.cpp, its one caller),
// not part of the library's interface.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "core/comm/comm.h"
#include "optimizers/common/step_gate.h"
#include "optimizers/muon/layout.h"
#include "optimizers/muon/muon.h"
#include "optimizers/muon/newton_schulz.h"

namespace rfsdp {

// How the step runs Newton–Schulz: in `dtype` with `coefficients`;
// batch_same_shape: the matrices rooted on a rank with equal shape and steps as
// one batch, one bmm per product.
struct NsRun {
  at::ScalarType dtype = at::kFloat;
  NsCoefficients coefficients;
  bool batch_same_shape = false;
  // Matrices orthogonalised here this step, per layout matrix (added to; null: not counted,
  // and the check below is off). Every matrix rooted here must be, or the step fails.
  std::vector<int64_t>* orthogonalised = nullptr;
  // Tests only (fault injection): layout parameters ([k] != 0) whose Newton–Schulz is left
  // out, so that the tests see the step refuse it.
  const std::vector<char>* skip_for_test = nullptr;
};

// A Muon matrix's rows here after Newton–Schulz: o, fp32 [rows here, cols],
// adjust_lr's scale in it (each column block's); w, the parameter's same rows (a view).
struct MuonPiece {
  size_t matrix = 0;
  int64_t row0 = 0;  // o's first row in the matrix
  at::Tensor o, w;
};

// One Muon step over the layout's parameters from the updates to orthogonalise
// (u[i]: this rank's shard of parameter i, contiguous fp32, set by make_update(i)
// when the step needs it; options: one per layout parameter): a parameter whose
// every matrix is held whole here, when not batching, orthogonalised at once (its
// update still in cache); every other matrix gathered to its root (one
// all-to-all), Newton–Schulz there, its failures (an error, a result that is not
// finite) recorded in `gate`, then gate.agree() (the caller's other checks
// agreed in the same all-reduce), commit() (the caller's state), the results
// scattered back (one all-to-all) and applied: p <- p (1 - lr wd) - lr o.
// grad_ranks (null: every parameter steps): read after gate.agree(), a layout
// parameter k with grad_ranks[k] == 0 (no rank had its gradient) takes part in
// the exchanges but is not changed, as torch skips a parameter without one.
// Collective when comm is set; a rank whose gate failed before takes part alike.
void muon_step_from_updates(Comm* comm, const MuonLayout& layout, const NsRun& ns,
                            const std::vector<MuonOptions>& options,
                            const std::vector<at::Tensor>& params, std::vector<at::Tensor>& u,
                            const std::function<void(size_t)>& make_update, StepGate& gate,
                            const std::function<void()>& commit,
                            const std::vector<int64_t>* grad_ranks,
                            const std::function<void(std::vector<MuonPiece>&)>* finish = nullptr);
// (finish, where set, applies the update in place of step 4's p (1 - lr wd) - lr o:
// it is given every matrix's rows here, of the parameters that step.)

}  // namespace rfsdp
