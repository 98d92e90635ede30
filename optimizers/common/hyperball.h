// Hyperball ("Fantastic Pretraining Optimizers II"; MuonH, AdamH): a matrix keeps
// its Frobenius norm R, and its update is normalised: u = d / (|d|_F + 1e-8),
// W <- W - lr R u, W <- R W / (|W|_F + 1e-8). One home for Muon's (and NorMuon's)
// and AdamW's: the norms from float64 partial sums, and the one all-reduce of the
// sums of every parameter that ranks cut.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "core/comm/comm.h"
#include "core/ragged/tensor_shard.h"

namespace rfsdp {

// Whether ranks cut the parameter (its rows lie on more than one rank: its norms
// need a sum across them). A replicated one (`replicated`, or every rank that
// holds rows holds all of them) is not cut; `shard` must know every rank's rows
// where world > 1.
bool cut_across_ranks(const TensorShard& shard, bool replicated);

// The first rank that holds rows of it (or 0): the rank a checkpoint takes the
// radius (one value every holder keeps) from.
int first_holder(const TensorShard& shard);

// Sums every slot with cut[slot] set across the ranks (one float64 all-reduce for
// all of them; nothing where none is cut or comm is null). Returns the bytes this
// rank sent into the all-reduce (its input's size).
int64_t sum_cut_slots(Comm* comm, std::vector<double>* sums, const std::vector<char>& cut);

// sum(a * b) accumulated in float64 (a 0-D tensor on a's device, read with the
// others at once): the products rounded to fp32 (2^-24 relative each), the sum not.
at::Tensor sum_of_products(const at::Tensor& a, const at::Tensor& b);

// One parameter's step from its global sums: |W|^2 (ww), <W, d> (wd) and |d|^2
// (dd), d the direction before the learning rate. W_new = s (W - a d) with
// a = lr R / (|d| + 1e-8) and s = R / (|W - a d| + 1e-8), where
// |W - a d|^2 = ww - 2 a wd + a^2 dd (no second pass over W).
struct HyperballScale {
  double a = 0, s = 1;
};
HyperballScale hyperball_scale(double lr, double radius, double ww, double wd, double dd);

}  // namespace rfsdp
