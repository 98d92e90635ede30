// Cut rows of tiles through the owner exchange: the exchange of a tiled
// optimizer's cut rows (one unit per row, owned by the rank holding its first
// element), and the first trip of every step, the rows' gradients to their
// owners with the check that every holder steps the row alike.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "core/ragged/param_shard.h"
#include "optimizers/common/owner_exchange.h"
#include "optimizers/common/tiles.h"

namespace rfsdp {

class Comm;

// One unit per cut row (in order) over the parameters' ranks (every rank's rows
// known for a parameter with cut rows; comm null: one rank).
OwnerExchange cut_exchange(const std::vector<CutTileRow>& cut, const std::vector<ParamShard>& params,
                           Comm* comm);

// The cut rows' gradients into (*grads)[row] at their owners (flat, the row's
// elements) from every holder's params[i].grad where steps[i]. Returns what is
// wrong where a row has a gradient on some of its ranks and none on others
// (empty: nothing; found at the row's owner). One all-to-all; one host read at
// owners of cut rows.
std::string gather_cut_grads(const OwnerExchange& exchange, const std::vector<CutTileRow>& cut,
                             const std::vector<ParamShard>& params, const std::vector<bool>& steps,
                             Comm* comm, std::vector<at::Tensor>* grads);

}  // namespace rfsdp
