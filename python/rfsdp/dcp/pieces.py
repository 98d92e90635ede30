"""A rank's pieces (rectangles) of global tensors: where they lie (Entry, one
tensor of a checkpoint), and the tensors rfsdp hands DCP for them, described
through its _Checkpointable protocol as DTensor is (Pieces; ShardedRows is a
sharded parameter in a model's "sharded" state dict, Placed an optimizer
state in one)."""
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


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


def row_pieces(t, info):
    """[(offsets, sizes, view of t)]: the rectangles of the rows info describes,
    as views of t (a shard, or a state shaped like it); a piece that is no rows
    (info.box: a tensor-parallel column piece) is one rectangle."""
    if info.box is not None:
        _, offsets, sizes = info.box
        return [(tuple(offsets), tuple(sizes), t.detach().view(sizes))] if t.numel() else []
    rows = t.detach().reshape(-1, info.row_len)
    return [(o, s, rows[first:first + n].view(s))
            for o, s, first, n in rectangles(info.global_shape, info.row_dims, info.row_begin,
                                             info.row_end)]


class LayoutError(ValueError):
    """A state tensor whose place in a global tensor cannot be described."""


class Entry:
    """One tensor of a checkpoint: its key, global shape, dtype and this rank's
    pieces [(offsets, sizes, local tensor)] on `device`; replicated (a plain
    tensor) when pieces is None."""

    def __init__(self, key, shape, dtype, pieces=None, tensor=None, device=None):
        self.key, self.shape, self.dtype = key, None if shape is None else tuple(shape), dtype
        self.pieces, self.tensor = pieces, tensor
        self.device = device if device is not None else \
            tensor.device if tensor is not None else torch.device("cpu")
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


def rows_entry(key, t, info):
    """t holds the rows info describes (a shard, or a state shaped like it),
    written by this rank (within its shard group)."""
    if len(info.global_shape) == 0:
        raise LayoutError("0-D sharded tensor '%s' is not supported" % key)
    e = Entry(key, info.global_shape, t.dtype, row_pieces(t, info), device=t.device)
    e.info = info
    return e


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
            "full tensors with rfsdp.set_state_dict_type(model or optimizer, 'full')" % func)

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
        self = Pieces.__new__(cls, info.global_shape, local.dtype, row_pieces(local, info),
                              local.device)
        self.local, self.info = local.detach(), info
        return self

    def __init__(self, local, info):
        torch.Tensor.__init__(self)

    def full_tensor(self) -> torch.Tensor:
        """The whole tensor on every rank of the shard group (collective)."""
        from .gather import full_rows
        return full_rows([(self.local, self.info)], self.info.process_group)[0]

    def __repr__(self, **kwargs):
        return "ShardedRows(global shape %s, rows [%d, %d) of %d)" % (
            tuple(self.shape), self.info.row_begin, self.info.row_end, self.info.full_rows)

    def __reduce_ex__(self, protocol):  # torch.save: the rows and where they sit
        s = self.info.shard
        return (_rebuild_sharded_rows, (self.local, s.name, list(s.shape), s.row_dims,
                                        s.row_begin, s.row_end, [tuple(r) for r in s.rank_rows]))


def _rebuild_sharded_rows(local, name, shape, row_dims, row_begin, row_end, rank_rows):
    from ..fsdp.unit import ShardInfo
    return ShardedRows(local, ShardInfo(name, shape, row_dims, row_begin, row_end,
                                        rank_rows=rank_rows))


torch.serialization.add_safe_globals([_rebuild_sharded_rows])


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
