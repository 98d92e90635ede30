// Cut rows of tiles through the owner exchange: the exchange of a tiled
// optimizer's cut rows (one unit per row, owned by the rank holding its first
// element), and the first trip of every step, the rows' gradients to their
// owners with the check that every holder steps the row alike.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "core/ragged/param_shard.h"
#include "optimizers/common/owner_exchange.h"
#include "optimizers/common/tiles.h"

namespace rfsdp {

class Comm;
class StepGate;

// One unit per cut row (in order) over the parameters' ranks. Throws
// std::invalid_argument, naming the optimizer `who` and the parameter, where a
// parameter has cut rows and comm is not the group of its ranks (the holders
// send the rows to their owner).
OwnerExchange cut_exchange(const char* who, const std::vector<CutTileRow>& cut,
                           const std::vector<ParamShard>& params, Comm* comm);

// The cut rows' gradients at their owners (per row, flat, the row's elements;
// undefined elsewhere) from every holder's gradient of the parameters that step.
// A row with a gradient on some of its ranks and none on others is recorded in
// `gate` (at the row's owner). One all-to-all and, at owners of cut rows, one
// host read; nothing where there are no cut rows.
std::vector<at::Tensor> gather_cut_grads(const OwnerExchange& exchange,
                                         const std::vector<CutTileRow>& cut,
                                         const std::vector<ParamShard>& params,
                                         const std::vector<size_t>& stepping, Comm* comm,
                                         StepGate& gate);

}  // namespace rfsdp
