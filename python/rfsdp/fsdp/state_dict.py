"""State dicts of sharded models: FSDP's two meanings, chosen explicitly.

model.state_dict() never returns local shards as if they were the parameters:
- "sharded" (the default, as FSDP2's DTensors): each sharded parameter is a
  ShardedRows, a tensor of the parameter's global shape that holds only this
  rank's rows (.local) and where they sit (.info, .pieces); DCP saves and loads
  it as it does DTensors (each rank writes its rows; rfsdp.checkpoint builds on
  the same pieces).
- "full": plain tensors of the global shapes, gathered unit by unit (one fp32
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
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .._comm import check_in, make_comm
from .unit import shard_info

KINDS = ("sharded", "full")


def rectangles(global_shape, row_dims, row_begin, row_end):
    """[(offsets, sizes, first local row, rows)]: rows [row_begin, row_end) of a
    tensor seen as rows over its first row_dims dims, as rectangles of the global
    tensor (an [E, H, I] stack cut inside an expert: up to three)."""
    shape = list(global_shape)
    if row_end <= row_begin:
        return []
    if row_dims == 1 or len(shape) <= 1:
        if len(shape) == 0:
            return [((), (), 0, 1)]
        return [((row_begin,) + (0,) * (len(shape) - 1), (row_end - row_begin, *shape[1:]), 0,
                 row_end - row_begin)]
    if row_dims != 2:
        raise ValueError("rows over %d dims have no rectangles" % row_dims)
    h, rest = shape[1], shape[2:]
    out, r = [], row_begin
    while r < row_end:
        e, within = divmod(r, h)
        if within or row_end - r < h:  # a partial expert
            n = min(h - within, row_end - r)
            out.append(((e, within) + (0,) * len(rest), (1, n, *rest), r - row_begin, n))
        else:  # whole experts
            n = (row_end - r) // h
            out.append(((e, 0) + (0,) * len(rest), (n, h, *rest), r - row_begin, n * h))
        r += out[-1][3]
    return out


class Pieces(torch.Tensor):
    """This rank's pieces of one global tensor, as DCP sees them through its
    _Checkpointable protocol (as DTensor does): one write item and one chunk per
    piece, found again by its offsets. Every rank describes only its own pieces:
    those it reads (`pieces`) and those it writes (`writes`, default the same; fewer
    where another rank writes some: an HSDP replica, a shared block scale). A
    tensor subclass without storage, of the global size: DCP passes tensors
    through its planners and drops other objects. Any tensor operation on it is an
    error (it holds no global data)."""

    @staticmethod
    def __new__(cls, shape, dtype, pieces, device="cpu", writes=None):
        self = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype,
                                                    device=device)
        self.pieces = {torch.Size(o): t.contiguous() for o, _, t in pieces if t.numel()}
        self.writes = self.pieces if writes is None else \
            {torch.Size(o): t.contiguous() for o, _, t in writes if t.numel()}
        return self

    def __init__(self, shape, dtype, pieces, device="cpu", writes=None):
        super().__init__()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(
            "rfsdp: %s on a sharded state-dict entry, which holds only this rank's rows of a "
            "tensor of the global shape: use .local (the rows) or .full_tensor(), or ask for "
            "full tensors with rfsdp.set_state_dict_type(model, 'full')" % func)

    def __create_write_items__(self, fqn, obj):
        return [WriteItem(index=MetadataIndex(fqn, o), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=o, sizes=t.size()),
                              properties=TensorProperties.create_from_tensor(t),
                              size=self.size()))
                for o, t in self.writes.items()]

    def __create_chunk_list__(self):
        return [ChunkStorageMetadata(offsets=o, sizes=t.size()) for o, t in self.pieces.items()]

    def __get_tensor_shard__(self, index):
        o = torch.Size(index.offset)
        return self.pieces[o] if o in self.pieces else self.writes[o]


class ShardedRows(Pieces):
    """A sharded parameter in a "sharded" state dict: global shape; .local is this
    rank's rows (a view of the shard), .info its ShardInfo."""

    @staticmethod
    def __new__(cls, local, info):
        rows = local.detach().reshape(-1, info.row_len)
        pieces = [(o, s, rows[first:first + n].view(s))
                  for o, s, first, n in rectangles(info.global_shape, info.row_dims,
                                                   info.row_begin, info.row_end)]
        self = Pieces.__new__(cls, info.global_shape, local.dtype, pieces, local.device)
        self.local, self.info = local.detach(), info
        return self

    def __init__(self, local, info):
        torch.Tensor.__init__(self)

    def full_tensor(self) -> torch.Tensor:
        """The whole tensor on every rank of the shard group (collective)."""
        return gather_rows([(self.local, self.info)], self.info.process_group)[0]

    def __repr__(self, **kwargs):
        return "ShardedRows(global shape %s, rows [%d, %d) of %d)" % (
            tuple(self.shape), self.info.row_begin, self.info.row_end, self.info.full_rows)

    def __reduce_ex__(self, protocol):  # torch.save: the rows and where they sit
        s = self.info.shard
        return (_rebuild_sharded_rows, (self.local, s.name, list(s.shape), s.row_dims,
                                        s.row_begin, s.row_end, [tuple(r) for r in s.rank_rows]))


def _rebuild_sharded_rows(local, name, shape, row_dims, row_begin, row_end, rank_rows):
    from .unit import ShardInfo
    return ShardedRows(local, ShardInfo(name, shape, row_dims, row_begin, row_end,
                                        rank_rows=rank_rows))


torch.serialization.add_safe_globals([_rebuild_sharded_rows])


def gather_rows(items, pg):
    """The full tensors of [(local rows, info)] of one shard group, on every rank:
    one all-gather of every rank's rows, padded to the longest rank's."""
    world = pg.size() if pg is not None else 1
    sizes = []
    for local, info in items:
        rr = info.rank_rows
        if len(rr) != world:
            raise ValueError("rfsdp: '%s' does not know every rank's rows (%d of %d ranks); "
                             "only shards made by fully_shard or FSDP2 can be gathered"
                             % (info.name, len(rr), world))
        sizes.append(max(e - b for b, e in rr) * info.row_len)
    per_rank = sum(sizes)
    device = items[0][0].device
    mine = torch.zeros(per_rank, dtype=torch.float32, device=device)
    at = 0
    for (local, info), n in zip(items, sizes):
        flat = local.detach().reshape(-1)
        mine[at:at + flat.numel()] = flat
        at += n
    every = mine
    if world > 1:
        every = torch.empty(world * per_rank, dtype=torch.float32, device=device)
        dist.all_gather_into_tensor(every, mine, group=pg)
    out, at = [], 0
    for (local, info), n in zip(items, sizes):
        full = torch.empty(info.full_rows, info.row_len, dtype=local.dtype, device=device)
        for r, (b, e) in enumerate(info.rank_rows):
            start = r * per_rank + at
            full[b:e] = every[start:start + (e - b) * info.row_len].view(e - b, info.row_len)
        out.append(full.view(info.global_shape))
        at += n
    return out


class _Settings:
    def __init__(self, kind, cpu_offload, rank0_only, timeout_s):
        if kind not in KINDS:
            raise ValueError("set_state_dict_type: kind must be 'sharded' or 'full', got %r"
                             % (kind,))
        self.kind, self.cpu_offload, self.rank0_only = kind, bool(cpu_offload), bool(rank0_only)
        self.timeout_s = float(timeout_s)


_DEFAULT = _Settings("sharded", False, False, 300.0)


def set_state_dict_type(model: torch.nn.Module, kind: str, *, cpu_offload: bool = True,
                        rank0_only: bool = True, timeout_s: float = 300.0) -> None:
    """What model.state_dict() returns for model and every sharded module in it:
    "sharded" (ShardedRows: this rank's rows, with the global shape) or "full"
    (tensors of the global shapes; cpu_offload: on the CPU; rank0_only: on rank 0,
    the other ranks' dicts lack them). A full state dict is collective; a rank
    left alone in it fails after timeout_s seconds."""
    settings = _Settings(kind, cpu_offload, rank0_only, timeout_s)
    found = False
    for m in model.modules():
        if getattr(m, "_rfsdp_unit", None) is not None:
            m._rfsdp_state_dict = settings
            found = True
    if not found:
        raise ValueError("set_state_dict_type: the model has no fully_shard modules")


def get_state_dict_type(model: torch.nn.Module) -> str:
    return getattr(model, "_rfsdp_state_dict", _DEFAULT).kind


def dcp_caller_options(function="_get_model_state_dict"):
    """(full_state_dict, cpu_offload) of the torch.distributed.checkpoint.state_dict
    call (get_model_state_dict, get_optimizer_state_dict: their `function`) that
    called the state_dict() asking, else None: torch has no hook for state dicts
    that are neither FSDP1's nor DTensors."""
    import sys
    f = sys._getframe(2)
    for _ in range(8):
        if f is None:
            return None
        if f.f_code.co_name == function and \
                f.f_globals.get("__name__") == "torch.distributed.checkpoint.state_dict":
            info = f.f_locals.get("info")
            return None if info is None else (bool(info.full_state_dict), bool(info.cpu_offload))
        f = f.f_back
    return None


def _settings_of(module):
    explicit = getattr(module, "_rfsdp_state_dict", None)
    if explicit is not None:
        return explicit
    dcp_options = dcp_caller_options()
    if dcp_options is not None and dcp_options[0]:
        return _Settings("full", dcp_options[1], dcp_options[1], _DEFAULT.timeout_s)
    return _DEFAULT


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
    settings = _settings_of(module)
    items = _keys(module, prefix)
    if settings.kind == "sharded":
        for keys, sp in items:
            for k in keys:
                state_dict[k] = ShardedRows(sp, shard_info(sp))
        return
    unit = module._rfsdp_unit
    _check_in(unit, settings, "model.state_dict() (full)")
    with torch.no_grad():
        full = gather_rows([(sp, shard_info(sp)) for _, sp in items], unit.process_group)
    keep = not settings.rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    for (keys, _), t in zip(items, full):
        for k in keys:
            if keep:
                state_dict[k] = t.cpu() if settings.cpu_offload else t
            else:
                state_dict.pop(k, None)


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
    return v.detach().reshape(-1, info.row_len)[info.row_begin:info.row_end].reshape(sp.shape)


def install(module: torch.nn.Module) -> None:
    """The state-dict hooks of a module fully_shard sharded parameters of."""
    if getattr(module, "_rfsdp_unit", None):
        module.register_state_dict_post_hook(_post_state_dict)
        module.register_load_state_dict_pre_hook(_pre_load_state_dict)
