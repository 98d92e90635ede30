"""fully_shard over tensor-parallel modules (torch's parallelize_module first, as
torchtitan does): a parameter left as a DTensor over a 1-D tensor-parallel mesh
(ColwiseParallel's Shard(0), RowwiseParallel's Shard(1), SequenceParallel's
Replicate()) is planned and sharded as its local piece, over the data-parallel
ranks alone: the unit's all-gather and reduce-scatter run on dp, zero-copy, as
for any parameter. Forward and backward see the gathered piece as the DTensor
torch's tensor-parallel layers expect. The shard presents its place in the
global tensor (TPPiece.shard_info: rows of it, or the column parts of a
Shard(1) matrix, over the ranks along dp and tp), so the optimizers, clipping
and checkpoints take it as they take FSDP2's 2-D parameters."""
import torch
import torch.distributed as dist

from .. import _C
from .dtensor import mesh_group, mesh_key, root_mesh
from .unit import ShardInfo


def _names(mesh):
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError("fully_shard: a mesh without dimension names; rfsdp finds the data- and "
                         "tensor-parallel dims of a root mesh by name: give it mesh_dim_names")
    return tuple(names)


def _same_root(a, b):
    return a is b or (mesh_key(a) == mesh_key(b) and _names(a) == _names(b))


class MeshDims:
    """Where a unit's shards lie in the root mesh its dp mesh was sliced (or
    flattened) from: the root, and the names of the root dims along which the
    unit's shard group and (HSDP) replicate group run, found from the groups'
    ranks (so a flattened dim, mesh["dp", "ep"]._flatten(), is its root dims).
    Every shard's ShardInfo carries the names of the root dims it is sharded along
    (mesh_dims), so an optimizer over several of them agrees over all those dims."""

    def __init__(self, dp_mesh, pg, rg):
        self.root = root_mesh(dp_mesh)
        self.pg = pg
        self.shard_dims = self._dims_of(pg)
        self.replicate_dims = self._dims_of(rg) if rg is not None else ()

    def _dims_of(self, group):
        """The root's dims (names) along which the ranks of group differ."""
        grid = self.root.mesh
        coords = []
        for r in dist.get_process_group_ranks(group):
            at = (grid == r).nonzero()
            if at.shape[0] != 1:
                raise ValueError("fully_shard: rank %d of the mesh's group is not in its root mesh "
                                 "%s" % (r, _names(self.root)))
            coords.append([int(x) for x in at[0]])
        names = _names(self.root)
        return tuple(names[d] for d in range(self.root.ndim)
                     if len({c[d] for c in coords}) > 1)

    def dp_index(self, rank):
        """A global rank's place along the unit's shard dims (its rows of the plan):
        its coordinates along them, row-major in the root's order, as a mesh's
        groups order their ranks (checked against this rank's place in the group)."""
        names = _names(self.root)
        at = [int(x) for x in (self.root.mesh == rank).nonzero()[0]]
        k = 0
        for n in self.shard_dims:
            d = names.index(n)
            k = k * self.root.mesh.shape[d] + at[d]
        if rank == dist.get_rank() and k != dist.get_rank(self.pg):
            raise ValueError("fully_shard: the mesh's shard group orders its ranks unlike the "
                             "root mesh's dims %s; build the mesh with init_device_mesh"
                             % (self.shard_dims,))
        return k


class TPPiece:
    """One tensor-parallel parameter of a unit: its tp mesh and placement, its
    global shape, and where its local piece lies in it."""

    def __init__(self, fqn, p, dims: MeshDims):
        from torch.distributed.tensor import Replicate, Shard
        mesh, placements = p.device_mesh, tuple(p.placements)
        what = "fully_shard: parameter '%s' (a DTensor with placements %s over mesh dims %s)" % (
            fqn, placements, mesh.mesh_dim_names)
        if mesh.ndim != 1:
            raise ValueError("%s: rfsdp.fully_shard takes parameters torch's tensor parallelism "
                             "distributed over a 1-D mesh (mesh['tp']); shard a parameter over "
                             "more dims with torch FSDP2 (its optimizers take those)" % what)
        if not _same_root(root_mesh(mesh), dims.root):
            raise ValueError("%s: its mesh is not sliced from the root mesh fully_shard's mesh "
                             "(%s) is: slice mesh['tp'] and mesh['dp'] from one DeviceMesh"
                             % (what, _names(dims.root)))
        self.tp_dim = _names(mesh)[0]
        if self.tp_dim in dims.shard_dims + dims.replicate_dims:
            raise ValueError("%s is already distributed over '%s', a dim fully_shard's mesh spans: "
                             "give fully_shard the data-parallel dims alone" % (what, self.tp_dim))
        x = placements[0]
        shape = tuple(p.shape)
        n = mesh.size()
        if n == 1 and (x.is_shard() or isinstance(x, Replicate)):
            self.dim = None  # (one tp rank: its piece is the tensor)
        elif x == Shard(0) and shape and shape[0] % n == 0:
            self.dim = 0
        elif x == Shard(1) and len(shape) == 2 and shape[1] % n == 0:
            self.dim = 1
        elif isinstance(x, Replicate):
            self.dim = None
        else:
            raise ValueError(
                "%s: rfsdp.fully_shard takes tensor-parallel pieces that are Shard(0) of a tensor "
                "whose first dim the %d tp ranks divide, Shard(1) of a matrix whose columns they "
                "divide, or Replicate(); this is not one. Use torch FSDP2 on the data-parallel "
                "dim for it (rfsdp's optimizers take its parameters), or give the layer sizes the "
                "tp ranks divide" % (what, n))
        loc = p._local_tensor
        want = list(shape)
        if self.dim is not None:
            want[self.dim] //= n
        if list(loc.shape) != want or not loc.is_contiguous():
            raise ValueError("%s: its local tensor is %s%s, not this rank's piece %s of equal "
                             "contiguous pieces" % (what, tuple(loc.shape), "" if loc.is_contiguous()
                                                    else " (non-contiguous)", tuple(want)))
        self.mesh, self.placements, self.shape, self.stride = mesh, placements, shape, p.stride()
        self.parts, self.part = n, mesh.get_local_rank()
        self.dims = dims

    def wrap(self, piece: torch.Tensor):
        """piece (this rank's gathered piece: a view of the unit's buffer) as the
        DTensor the tensor-parallel layer expects."""
        from torch.distributed.tensor import DTensor
        return DTensor.from_local(piece, self.mesh, self.placements, run_check=False,
                                  shape=torch.Size(self.shape), stride=self.stride)

    def grad_piece(self, g):
        """A gradient of the DTensor parameter as this rank's piece (redistributed to
        the parameter's placements first: a Partial one is summed over tp)."""
        from torch.distributed.tensor import DTensor
        if not isinstance(g, DTensor):
            return g
        if tuple(g.placements) != self.placements:
            g = g.redistribute(placements=self.placements)
        return g._local_tensor

    def granule(self, g, row_dims, whole):
        """The plan's granule for this piece, from the policy's granule g for the
        global tensor (rows over its first row_dims dims, or `whole`): kept where
        the piece's rows take it (a Shard(0) piece whose rows it divides; Shard(1)
        and Replicate pieces have the tensor's rows), else the piece whole
        (unequal blocks a tp cut splits)."""
        if g == whole or self.dim != 0:
            return g
        rows = self.shape[0] // self.parts
        for n in self.shape[1:row_dims]:
            rows *= n
        return g if rows % g == 0 else whole

    def shard_info(self, piece_shard, blocks=None) -> ShardInfo:
        """The ShardInfo of a shard whose rows of this piece piece_shard (the
        plan's TensorShard, every dp rank's rows) describes: its rows of the global
        tensor (Shard(0): the piece's rows follow the earlier parts'; Replicate:
        the same), or column parts (Shard(1)), over the ranks along the dp shard
        dim and, where tp shards it, tp; replicated along the others. blocks: the
        global tensor's logical blocks the plan kept whole ((sizes, dim): Muon's
        split, which it takes from the shard), or None."""
        info = self._shard_info(piece_shard)
        if blocks is not None:
            info.shard = info.shard.with_blocks(list(blocks[0]), blocks[1])
        return info

    def _shard_info(self, piece_shard) -> ShardInfo:
        d = self.dims
        root = d.root
        rnames = _names(root)
        shard_names = d.shard_dims + ((self.tp_dim,) if self.dim is not None else ())
        rep_names = d.replicate_dims + ((self.tp_dim,) if self.dim is None else ())
        name = piece_shard.name
        if self.dim is None:  # (the unit's own shard group; replicated over tp too)
            rg = mesh_group(root, [rnames.index(x) for x in rep_names])
            return ShardInfo.of(piece_shard, d.pg, rg, mesh_dims=(root, shard_names))
        pg = mesh_group(root, [rnames.index(x) for x in shard_names])
        rg = mesh_group(root, [rnames.index(x) for x in rep_names]) if rep_names else None
        # Every rank of pg: its place in the unit's shard group (its rows of the
        # piece) and its tp part.
        tp_at = rnames.index(self.tp_dim)
        grid = root.mesh
        piece_rows = piece_shard.rank_rows
        coords = []
        for r in dist.get_process_group_ranks(pg):
            coords.append((d.dp_index(r), int((grid == r).nonzero()[0][tp_at])))
        mine = coords[dist.get_rank(pg)]
        if self.dim == 0:
            per = piece_shard.full_rows
            rows = [(t * per + piece_rows[k][0], t * per + piece_rows[k][1]) for k, t in coords]
            b, e = rows[dist.get_rank(pg)]
            shard = _C.TensorShard(name, list(self.shape), piece_shard.row_dims, b, e, rows)
            return ShardInfo.of(shard, pg, rg, mesh_dims=(root, shard_names))
        # Shard(1): the piece is a column block [R, W]; its rows are rows of part t.
        R, W = self.shape[0], self.shape[1] // self.parts
        rows = [(t * R + piece_rows[k][0], t * R + piece_rows[k][1]) for k, t in coords]
        b, e = rows[dist.get_rank(pg)]
        k, t = mine
        box = (self.shape, (piece_rows[k][0], t * W), (piece_rows[k][1] - piece_rows[k][0], W))
        shard = _C.TensorShard.column_parts(name, list(self.shape), self.parts, b, e, rows)
        return ShardInfo.of(shard, pg, rg, box=box, mesh_dims=(root, shard_names))


def local_blocks(blocks, blocks_dim, piece: TPPiece):
    """A parameter's logical blocks (sizes along each matrix's rows, blocks_dim 0,
    or columns, 1: of a 3-D stack's experts, tensor dims 1 and 2) as blocks of
    this rank's piece: cut at the piece's edges where tp splits that dim (whole
    blocks where the parts hold them), unchanged where it does not (a stack's
    Shard(0) splits experts, never their blocks)."""
    if blocks is None or piece is None:
        return blocks
    dim = blocks_dim + (1 if len(piece.shape) == 3 else 0)
    if piece.dim != dim:
        return blocks
    size = piece.shape[dim] // piece.parts
    lo, hi = piece.part * size, (piece.part + 1) * size
    out, at = [], 0
    for n in blocks:
        a, b = max(at, lo), min(at + n, hi)
        if a < b:
            out.append(b - a)
        at += n
    return out
