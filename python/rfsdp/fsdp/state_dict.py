"""State dicts of sharded models: FSDP's two meanings, chosen explicitly.

model.state_dict() never returns local shards as if they were the parameters:
- "sharded" (the default, as FSDP2's DTensors): each sharded parameter is a
  ShardedRows, a tensor of the parameter's global shape that holds only this
  rank's rows (.local) and where they sit (.info, .pieces); DCP saves and loads
  it as it does DTensors (each rank writes its rows; rfsdp.checkpoint builds on
  the same pieces).
- "full": plain tensors of the global shapes, gathered unit by unit (one
  all-gather per unit, freed before the next: one unit's parameters are in
  flight at a time), on the CPU with cpu_offload, on rank 0 alone with rank0_only
  (the other ranks' dicts lack those keys). Collective: every rank must call it;
  a rank calling it alone gets an error naming that, after `timeout_s`.
torch.distributed.checkpoint.state_dict's get_model_state_dict gives the full
kind when its options say full_state_dict (rank 0 only with cpu_offload, as it
does for FSDP2), else the sharded one.

model.load_state_dict takes either: a full state dict (an unsharded model's:
each rank keeps its rows) or a sharded one of the same layout (this rank's rows).
A sharded state dict of another world size or plan goes through
torch.distributed.checkpoint (dcp.load into model.state_dict()) or rfsdp.checkpoint."""
import torch
import torch.distributed as dist

from .._comm import check_in, make_comm
from ..dcp.gather import full_rows
from ..dcp.pieces import Pieces, ShardedRows
from ..dcp.pieces import _rebuild_sharded_rows  # noqa: F401 (ShardedRows pickled before rfsdp.dcp name it here)
from ..dcp.state_dict_type import state_dict_type
from .unit import shard_info


def _keys(module, prefix):
    """[(state-dict keys, shard parameter)] of module's own unit."""
    unit = module._rfsdp_unit
    return [([prefix + fqn for _, _, fqn in uses], sp)
            for uses, sp in zip(unit.entries, unit.sharded)]


def _check_in(unit, settings, what):
    """Every rank of the shard group is here (a small collective with a timeout),
    else an error naming the cause instead of a hang in the gather."""
    pg = unit.process_group
    if pg.size() == 1:
        return
    comm = getattr(unit, "_state_dict_comm", None)
    if comm is None or unit._state_dict_timeout != settings.timeout_s:
        comm = unit._state_dict_comm = make_comm(pg, settings.timeout_s)
        unit._state_dict_timeout = settings.timeout_s
    check_in(comm, what, settings.timeout_s,
             every="every rank of the shard group (a full state dict gathers through every "
                   "rank, rank0_only too)")


def _post_state_dict(module, state_dict, prefix, local_metadata):
    settings = state_dict_type(module)
    items = _keys(module, prefix)
    if settings.kind == "sharded":
        for keys, sp in items:
            for k in keys:
                state_dict[k] = ShardedRows(sp, shard_info(sp))
        return
    unit = module._rfsdp_unit
    _check_in(unit, settings, "model.state_dict() (full)")
    with torch.no_grad():
        full = _full(items)
    keep = not settings.rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    for (keys, _), t in zip(items, full):
        for k in keys:
            if keep:
                state_dict[k] = t.cpu() if settings.cpu_offload else t
            else:
                state_dict.pop(k, None)


def _full(items):
    """The global tensors of [(keys, shard)], gathered over each one's shard group
    (the unit's, or, for a tensor-parallel piece, the ranks along dp and tp):
    one all-gather per group, in the order the groups first appear (every rank
    alike: the unit's parameters are in one order everywhere)."""
    by_group = {}
    for k, (_, sp) in enumerate(items):
        info = shard_info(sp)
        by_group.setdefault(id(info.process_group), (info.process_group, []))[1].append(
            (k, sp, info))
    out = [None] * len(items)
    for pg, group in by_group.values():
        for (k, _, _), t in zip(group, full_rows([(sp, info) for _, sp, info in group], pg)):
            out[k] = t
    return out


def _pre_load_state_dict(module, state_dict, prefix, local_metadata, strict, missing_keys,
                         unexpected_keys, error_msgs):
    """Each given value into this rank's rows, in place; the key then holds the
    shard itself, so nn.Module's own load (copy or assign) changes nothing more."""
    for keys, sp in _keys(module, prefix):
        info = shard_info(sp)
        for k in keys:
            if k not in state_dict:
                continue
            v = state_dict[k]
            with torch.no_grad():
                sp.copy_(_rows_for(k, v, info, sp))
            state_dict[k] = sp


def _rows_for(key, v, info, sp) -> torch.Tensor:
    if isinstance(v, ShardedRows):
        if tuple(v.shape) != tuple(info.global_shape) or \
                (v.info.row_begin, v.info.row_end) != (info.row_begin, info.row_end):
            raise ValueError(
                "load_state_dict: '%s' in the state dict is rows [%d, %d) of %s, but this rank "
                "holds rows [%d, %d) of %s: a sharded state dict loads only into the same "
                "layout; load a full state dict, or go through torch.distributed.checkpoint / "
                "rfsdp.checkpoint, which reshard" % (key, v.info.row_begin, v.info.row_end,
                                                     tuple(v.shape), info.row_begin, info.row_end,
                                                     tuple(info.global_shape)))
        return v.local
    if isinstance(v, Pieces) or not isinstance(v, torch.Tensor):
        raise ValueError("load_state_dict: '%s' is a %s, not a tensor of the global shape %s"
                         % (key, type(v).__name__, tuple(info.global_shape)))
    if tuple(v.shape) != tuple(info.global_shape):
        raise ValueError(
            "load_state_dict: '%s' has shape %s; the parameter's global shape is %s (this rank "
            "holds rows [%d, %d), shape %s): give full tensors of the global shapes or a "
            "sharded state dict" % (key, tuple(v.shape), tuple(info.global_shape), info.row_begin,
                                    info.row_end, tuple(sp.shape)))
    if info.box is not None:  # a tensor-parallel column piece: its rectangle
        _, offsets, sizes = info.box
        return v.detach()[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].reshape(sp.shape)
    return v.detach().reshape(-1, info.row_len)[info.row_begin:info.row_end].reshape(sp.shape)


def install(module: torch.nn.Module) -> None:
    """The state-dict hooks of a module fully_shard sharded parameters of."""
    if getattr(module, "_rfsdp_unit", None):
        module.register_state_dict_post_hook(_post_state_dict)
        module.register_load_state_dict_pre_hook(_pre_load_state_dict)
