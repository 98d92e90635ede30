"""Where each tensor of a sharded model's and optimizer's state lies in the global
tensors a checkpoint holds (torch.distributed.checkpoint's view of them), and the
objects that tell DCP so. rfsdp.checkpoint and the optimizers' state_dict (torch's
get_optimizer_state_dict / set_optimizer_state_dict) both build on it.

The optimizers describe their own state (C++: ShardedOptimizer::state_layout):
a state tensor of a parameter is one of
- "rows": this rank's rows of a tensor of the parameter's global shape (moments,
  momentum, 8-bit codes by element);
- "sequence": elements [offset, offset + numel) of a 1-D global sequence (block
  scales, Shampoo's and SOAP's per-tile factors, roots and bases);
- 0-D (a step count): the same on every rank.
A rank reads all of its pieces; it writes them less what another rank writes:
an HSDP replica other than the first writes nothing, and the leading elements
an earlier rank also holds (an 8-bit block's scale that ranks share) are that
rank's to write. Nothing here is collective but full_tensors."""
import torch
import torch.distributed as dist

from .fsdp.dtensor import info_of, is_dtensor, local
from .fsdp.state_dict import Pieces, rectangles

class LayoutError(ValueError):
    """A state tensor whose place in a global tensor cannot be described."""


class Entry:
    """One tensor of a checkpoint: its key, global shape, dtype and this rank's
    pieces [(offsets, sizes, local tensor)]; replicated (a plain tensor) when
    pieces is None."""

    def __init__(self, key, shape, dtype, pieces=None, tensor=None):
        self.key, self.shape, self.dtype = key, None if shape is None else tuple(shape), dtype
        self.pieces, self.tensor = pieces, tensor
        self.replica = 0      # HSDP: this rank's index in its replica group (0 writes)
        self.shared = 0       # leading elements an earlier rank writes (it reads them too)
        self.info = None      # the parameter's ShardInfo where shaped like it
        self.dtensor_of = None  # an FSDP2 parameter this state is shaped like

    def written(self):
        """The pieces this rank writes: none on an HSDP replica but the first, and
        a shared head left to the earlier rank that holds it."""
        if self.pieces is None or self.replica:
            return []
        if self.shared and self.pieces:
            (offset,), (n,), t = self.pieces[0]
            return [((offset + self.shared,), (n - self.shared,), t[self.shared:])] \
                if n > self.shared else []
        return self.pieces


def default_group(process_group=None):
    """The ranks a checkpoint (or a state dict of sharded states) is placed and
    gathered over: the given group, else torch.distributed's default group, else
    none (one process)."""
    if process_group is not None:
        return process_group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def replica_index(info):
    rg = info.replicate_group
    return 0 if rg is None else rg.rank()


def rows_entry(key, t, info):
    """t holds the rows info describes (a shard, or a state shaped like it)."""
    if len(info.global_shape) == 0:
        raise LayoutError("0-D sharded tensor '%s' is not supported" % key)
    rows = t.detach().reshape(-1, info.row_len)
    pieces = [(o, s, rows[first:first + n].reshape(s))
              for o, s, first, n in rectangles(info.global_shape, info.row_dims,
                                               info.row_begin, info.row_end)]
    e = Entry(key, info.global_shape, t.dtype, pieces)
    e.replica = replica_index(info)
    e.info = info
    return e


def param_entry(key, p):
    """A parameter fully_shard or FSDP2 sharded (its rows), or a plain one."""
    info = info_of(key, p)
    if info is None:
        return Entry(key, p.shape, p.dtype, tensor=p.detach())
    return rows_entry(key, local(p), info)


def state_entries(prefix, p, state, layout):
    """Entries of one parameter's optimizer state: layout, {name: (kind, total,
    offset, shared)}, is the optimizer's (see the module's text)."""
    info = info_of(prefix, p)
    out = []
    for name, t in sorted(state.items()):
        key = "%s.%s" % (prefix, name)
        t = t.detach()
        where = layout.get(name)
        if t.dim() == 0 or info is None:
            out.append(Entry(key, t.shape, t.dtype, tensor=t))
        elif where is None:
            raise LayoutError("optimizer state '%s' of shape %s has no layout"
                              % (key, tuple(t.shape)))
        elif where[0] == "rows":
            e = rows_entry(key, t, info)
            e.dtensor_of = p if is_dtensor(p) else None
            out.append(e)
        else:
            _, total, offset, shared = where
            e = Entry(key, (total,), t.dtype,
                      [((offset,), (t.numel(),), t.reshape(-1))] if t.numel() else [])
            e.shared = shared
            e.replica = replica_index(info)
            out.append(e)
    return out


class Placed(Pieces):
    """A global tensor as DCP sees this rank's part of it (Pieces: the pieces it
    reads, those it writes: Entry.written()), with .local, this rank's tensor."""

    @staticmethod
    def __new__(cls, shape, dtype, pieces, writes, local_tensor):
        self = Pieces.__new__(cls, shape, dtype, pieces, local_tensor.device, writes)
        self.local = local_tensor
        return self

    def __init__(self, shape, dtype, pieces, writes, local_tensor):
        torch.Tensor.__init__(self)

    def __repr__(self, **kwargs):
        return "Placed(global shape %s, %d pieces)" % (tuple(self.shape), len(self.pieces))


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


def full_tensors(entries, pg, device=None):
    """Every entry's global tensor on every rank of pg: each rank's written pieces
    (disjoint over the ranks) summed by one all-reduce per dtype. Collective."""
    out, flats = {}, {}
    for e in entries:
        if e.pieces is None:
            out[e.key] = e.tensor
            continue
        dev = device if device is not None else next(
            (t.device for _, _, t in e.pieces), torch.device("cpu"))
        full = torch.zeros(e.shape, dtype=e.dtype, device=dev)
        for o, s, t in e.written():
            full[tuple(slice(a, a + n) for a, n in zip(o, s))] = t.reshape(s)
        out[e.key] = full
        flats.setdefault((e.dtype, full.device), []).append(e.key)
    if pg is not None and pg.size() > 1:
        for (dtype, dev), keys in flats.items():
            # (Gloo sums no uint8: codes travel as int32, exact for sums of disjoint pieces)
            wire = torch.int32 if dtype in (torch.uint8, torch.int8, torch.bool) else dtype
            flat = torch.cat([out[k].reshape(-1).to(wire) for k in keys])
            dist.all_reduce(flat, group=pg)
            at = 0
            for k in keys:
                n = out[k].numel()
                out[k] = flat[at:at + n].to(dtype).view(out[k].shape)
                at += n
    return out
