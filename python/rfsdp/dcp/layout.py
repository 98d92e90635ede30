"""Where each tensor of a sharded model's and optimizer's state lies in the global
tensors a checkpoint holds (torch.distributed.checkpoint's view of them).
rfsdp.checkpoint and the optimizers' torch state dicts both build on it.

The optimizers describe their own state (C++: ShardedOptimizer::state_layout):
a state tensor of a parameter is one of
- "rows": this rank's rows of a tensor of the parameter's global shape (moments,
  momentum, 8-bit codes by element);
- "sequence": elements [offset, offset + numel) of a 1-D global sequence (block
  scales, Shampoo's and SOAP's per-tile factors, roots and bases), or where it
  gives runs ((offset, numel), ...), those one after another (a parameter held
  in column parts: a run per row);
- 0-D (a step count): the same on every rank.
A rank reads all of its pieces; it writes them less what another rank writes:
an HSDP replica other than the first writes nothing, and the leading elements
an earlier rank also holds (an 8-bit block's scale that ranks share) are that
rank's to write. Nothing here is collective."""
import torch.distributed as dist

from ..fsdp.dtensor import info_of, is_dtensor, local
from .pieces import Entry, LayoutError, Placed, rows_entry


def default_group(process_group=None):
    """The ranks a checkpoint (or a state dict of sharded states) is placed and
    gathered over: the given group, else torch.distributed's default group, else
    none (one process)."""
    if process_group is not None:
        return process_group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _replica_index(info):
    rg = info.replicate_group
    return 0 if rg is None else rg.rank()


def param_entry(key, p):
    """A parameter fully_shard or FSDP2 sharded (its rows), or a plain one."""
    info = info_of(key, p)
    if info is None:
        return Entry(key, p.shape, p.dtype, tensor=p.detach())
    e = rows_entry(key, local(p), info)
    e.replica = _replica_index(info)
    return e


def state_entries(prefix, p, state, layout):
    """Entries of one parameter's optimizer state: layout, {name: (kind, total,
    offset, shared, runs)}, is the optimizer's (see the module's text)."""
    info = info_of(prefix, p)
    out = []
    for name, t in sorted(state.items()):
        key = "%s.%s" % (prefix, name)
        t = t.detach()
        where = layout.get(name)
        if t.dim() == 0 or info is None:
            out.append(Entry(key, t.shape, t.dtype, tensor=t))
            continue
        if where is None:
            raise LayoutError("optimizer state '%s' of shape %s has no layout"
                              % (key, tuple(t.shape)))
        if where[0] == "rows":
            e = rows_entry(key, t, info)
            e.dtensor_of = p if is_dtensor(p) else None
        else:
            _, total, offset, shared, runs = where
            flat, pieces, at = t.reshape(-1), [], 0
            for o, n in runs or ((offset, t.numel()),):
                pieces.append(((o,), (n,), flat[at:at + n]))
                at += n
            if at != t.numel():
                raise LayoutError("optimizer state '%s': its runs hold %d elements, the tensor %d"
                                  % (key, at, t.numel()))
            e = Entry(key, (total,), t.dtype, pieces if t.numel() else [], device=t.device)
            e.shared = shared
        e.replica = _replica_index(info)
        out.append(e)
    return out


def dcp_value(e, local_tensor):
    """What DCP saves and loads for entry e: the tensor where replicated, a DTensor
    where e is shaped like an FSDP2 parameter (as torch's optimizers give their
    states), else a Placed of e's pieces. local_tensor: the rank's state tensor."""
    if e.pieces is None:
        return e.tensor
    p = e.dtensor_of
    if p is not None:
        from torch.distributed.tensor import DTensor
        return DTensor.from_local(local_tensor, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())
    return Placed(e.shape, e.dtype, e.pieces, e.written(), local_tensor)
