"""An rfsdp optimizer's state in torch's state-dict format, as DCP sees it:
placed ("sharded": each sharded state a DTensor like its FSDP2 parameter, else a
Placed of this rank's pieces of its global tensor) or gathered ("full"); and,
from a loaded state dict, this rank's tensors."""
import torch

from ..fsdp.dtensor import info_of, is_dtensor
from .gather import gather
from .layout import dcp_value, state_entries
from .pieces import Pieces


def _entries(params, state_of, layout_of):
    """{(parameter index, state name): layout.Entry} of every parameter's state."""
    out = {}
    for i, p in enumerate(params):
        for e in state_entries(str(i), p, state_of(p), layout_of(p)):
            out[(i, e.key.split(".", 1)[1])] = e
    return out


def place(sd, params, state_of, layout_of, kind, pg):
    """sd, torch's state dict of an optimizer over params (states keyed by index,
    this rank's tensors), as `kind` (state_dict_type.StateDictType) says: sharded
    states placed as DCP saves them, or every state whole (gathered over pg:
    collective), on the CPU with cpu_offload, on pg's rank 0 alone with rank0_only.
    state_of(p) and layout_of(p): p's live states and their layout (the
    optimizer's). Plain (replicated) parameters' states are plain tensors either way."""
    sharded = any(info_of("param", p) is not None for p in params)
    if kind.kind == "sharded" and not sharded:
        return sd
    layout = _entries(params, state_of, layout_of) if sharded else {}
    full = gather(list(layout.values()), pg) if kind.kind == "full" else None
    for i, st in sd["state"].items():
        for name, t in st.items():
            e = layout.get((i, name))
            if full is None:
                st[name] = t if e is None else dcp_value(e, t)
            else:
                v = t if e is None else full[e.key]
                st[name] = v.cpu() if kind.cpu_offload else v
    if full is not None and kind.rank0_only and pg is not None and pg.rank() != 0:
        sd["state"] = {}
    return sd


def _holds_full(states, params):
    """Whether a loaded state dict gives a sharded parameter's state as a tensor of
    the global shape (a full state dict) rather than this rank's."""
    return any(info_of("param", p) is not None and torch.is_tensor(v) and v.dim() > 0
               and not is_dtensor(v) and not isinstance(v, Pieces)
               for p, st in zip(params, states) for v in (st or {}).values())


def local_states(states, params, state_of, layout_of, what):
    """Each parameter's state as this rank keeps it, from a loaded state dict's
    (states: in params' order, None where it has none): a DTensor's or our
    pieces' local tensor, a tensor of this rank's shape as it is, or (a full
    state dict) this rank's pieces of a tensor of the global shape, as a new
    tensor. what: the optimizer's name, for errors."""
    full = _holds_full(states, params)
    out = []
    for i, (p, st) in enumerate(zip(params, states)):
        if not st:
            out.append(st)
            continue
        mine, placed = {}, {}
        if full and info_of("param", p) is not None:
            mine = {n: t.detach().clone() for n, t in state_of(p).items()}
            placed = {e.key.split(".", 1)[1]: e for e in state_entries(str(i), p, mine, layout_of(p))}
        out.append({name: _local(v, placed.get(name), mine.get(name), "%s.load_state_dict: state "
                                 "'%s'" % (what, name)) for name, v in st.items()})
    return out


def _local(v, e, mine, what):
    if is_dtensor(v):
        return v._local_tensor
    if isinstance(v, Pieces):
        if not hasattr(v, "local"):
            raise ValueError("%s is a %s without its local tensor" % (what, type(v).__name__))
        return v.local
    if e is None or e.pieces is None or not torch.is_tensor(v) or tuple(v.shape) != e.shape:
        return v
    with torch.no_grad():  # (the pieces are views of mine)
        for o, s, t in e.pieces:
            t.copy_(v[tuple(slice(a, a + n) for a, n in zip(o, s))].reshape(t.shape))
    return mine
