"""Parameters sharded by torch's FSDP2 as ragged shards: a DTensor Shard(0) over a
1-D mesh (FSDP), or (Replicate(), Shard(0)) over a 2-D mesh (HSDP), holds on each
rank the rows torch.chunk gives it: rows [r*c, min((r+1)*c, n)) with
c = ceil(n / m), possibly none. That is a ragged shard with every rank's rows
known, so rfsdp's optimizers take FSDP2's parameters (and DTensor gradients) as
they take fully_shard's, and update the local tensors in place. Over meshes of
more dims (tensor parallelism, expert parallelism, HSDP x TP) a parameter's
piece is the one torch's DTensor gives it; its shard group holds the ranks along
every sharded dim, its replicate group those along every Replicate dim."""
from typing import Optional

import torch
import torch.distributed as dist

from .unit import ShardInfo, shard_info


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without DTensor: nothing is one
        return None
    return DTensor


def is_dtensor(t) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def local(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """This rank's tensor of a DTensor (a view: updates land in the DTensor), else t."""
    if t is not None and is_dtensor(t):
        return t._local_tensor
    return t


def chunk_rows(n: int, world: int):
    """Every rank's rows [begin, end) of n rows split by torch.chunk (FSDP2's split)."""
    c = -(-n // world) if n else 0
    return [(min(r * c, n), min((r + 1) * c, n)) for r in range(world)]


def whole_mesh_group(mesh):
    """The process group of every rank of `mesh` (cached on it): torch.distributed's
    default group where the mesh is all of it, else the mesh flattened (collective
    the first time, on every rank of the world: as building an optimizer is)."""
    cached = getattr(mesh, "_rfsdp_whole_group", None)
    if cached is not None:
        return cached
    if mesh.ndim == 1:
        pg = mesh.get_group(0)
    elif mesh.size() == dist.get_world_size() and \
            mesh.mesh.flatten().tolist() == list(range(mesh.size())):
        pg = dist.group.WORLD
    else:
        pg = mesh._flatten().get_group(0)
    mesh._rfsdp_whole_group = pg
    return pg


def mesh_group(mesh, dims):
    """The process group of the ranks along `dims` of mesh (indices; this rank's
    slice: the other dims at its coordinates), in the mesh's row-major order: one
    dim's own group, the whole mesh's, else those dims sliced and flattened, cached
    on the root mesh by their names, so that every mesh sliced from one root (a
    parameter's, the optimizer's) gets the same group. Creating one is collective
    on every rank of the world, in the same order: as building an optimizer is."""
    dims = tuple(sorted(dims))
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    if len(dims) == mesh.ndim:
        return whole_mesh_group(mesh)
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError("a mesh without dimension names: rfsdp groups dims %s of it by name; "
                         "give the mesh mesh_dim_names" % (dims,))
    key = tuple(names[d] for d in dims)
    root = root_mesh(mesh)
    cache = root.__dict__.setdefault("_rfsdp_groups", {})
    if key not in cache:
        cache[key] = mesh[key]._flatten().get_group(0)
    return cache[key]


def mesh_key(mesh):
    """A mesh by its device type and ranks, not its object: torch's slicing may give
    a second mesh of the same shape, whose sub-meshes FSDP2 then places on."""
    return mesh.device_type, tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist())


def root_mesh(mesh):
    """The mesh a sub-mesh was sliced from (FSDP2 over mesh["dp"] leaves plain
    parameters, norms, on it), else mesh."""
    get = getattr(mesh, "_get_root_mesh", None)
    return get() if get is not None else mesh


def mesh_dims_of(p, info):
    """(root mesh, names of the root's dims p is sharded along; None where its mesh
    has no names) of a DTensor parameter or of a shard fully_shard made over a
    mesh (info.mesh_dims), else None."""
    if is_dtensor(p):
        names = p.device_mesh.mesh_dim_names
        return root_mesh(p.device_mesh), None if names is None else \
            tuple(names[d] for d, x in enumerate(p.placements) if is_sharded(x))
    return None if info is None else info.mesh_dims


def root_dims_sharded(placed, root):
    """The dims of `root` (indices) along which any of these parameters (their
    mesh_dims_of: each over root or a mesh sliced from it) is sharded, matched by
    name; every dim where a mesh has no names."""
    out = set()
    rnames = root.mesh_dim_names
    for _, names in placed:
        if names is None or rnames is None or any(n not in rnames for n in names):
            return tuple(range(root.ndim))
        out.update(rnames.index(n) for n in names)
    return tuple(sorted(out))


def is_sharded(x) -> bool:
    """Whether placement x shards a dimension: Shard, or FSDP2's _StridedShard over a
    tensor-parallel Shard (no Shard subclass in torch 2.11)."""
    from torch.distributed.tensor.placement_types import _StridedShard
    return x.is_shard() or isinstance(x, _StridedShard)


def _mesh_pieces(p, pg, dims):
    """Every rank of pg's piece of p, [(global offsets, local sizes)] in pg's rank
    order, as torch's DTensor computes them (_StridedShard included); pg's ranks
    are the mesh's ranks along `dims`, the other dims at this rank's coordinates."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    mesh = p.device_mesh
    grid = mesh.mesh
    mine = mesh.get_coordinate()
    out = []
    for g in range(dist.get_world_size(pg)):
        r = dist.get_global_rank(pg, g) if pg is not dist.group.WORLD else g
        coord = [int(c) for c in (grid == r).nonzero()[0]]
        if any(coord[d] != mine[d] for d in range(mesh.ndim) if d not in dims):
            raise AssertionError("rank %d of the group is not in this rank's slice" % r)
        shape, offset = _compute_local_shape_and_global_offset(p.shape, grid.shape, coord,
                                                               p.placements)
        out.append((tuple(offset), tuple(shape)))
    return out


def _mesh_shard(name, p, what):
    """The ShardInfo of a DTensor over a mesh of any number of dimensions: any mix
    of Shard / _StridedShard and Replicate placements (FSDP2 over a dp or (replicate,
    shard) mesh, with tensor parallelism or expert parallelism on further dims).
    The shard group is the ranks along its sharded dims, the replicate group those
    along its Replicate dims (mesh_group: one dim's group, else flattened). A piece
    of whole rows of the global tensor (FSDP's chunk, ColwiseParallel's Shard(0),
    an expert stack's Shard(0)) is rows as FSDP's are, every rank's known; one cut
    along another dim is a box (ShardInfo.of's): RowwiseParallel's Shard(1) of a
    matrix whose columns tp divides is rows of its column parts (C++'s
    TensorShard::col_parts: AdamW and Muon take it, AdamW8bit, Shampoo and SOAP
    where their blocks or tiles divide the part width), any other only the
    element-wise optimizers take, as rows of its column block."""
    from torch.distributed.tensor import Replicate, Shard
    mesh, placements = p.device_mesh, tuple(p.placements)
    for x in placements:
        if not (is_sharded(x) or isinstance(x, Replicate)):
            raise ValueError("%s: placement %s is not supported (rfsdp's optimizers take Shard, "
                             "_StridedShard and Replicate placements)" % (what, x))
    shard_dims = [d for d, x in enumerate(placements) if is_sharded(x)]
    rep_dims = [d for d, x in enumerate(placements) if isinstance(x, Replicate)]
    if not shard_dims:
        raise ValueError("%s is replicated, not sharded: shard it with Shard(0), or give it to "
                         "an optimizer of its own as a plain tensor" % what)
    shape = list(p.shape)
    if not shape:
        raise ValueError("%s is 0-D: nothing to shard" % what)
    pg = mesh_group(mesh, shard_dims)
    rg = mesh_group(mesh, rep_dims) if rep_dims else None
    loc = p._local_tensor
    if len(shard_dims) == 1 and placements[shard_dims[0]] == Shard(0):
        # FSDP2's one split (FSDP, HSDP): torch.chunk's rows, known without the mesh's
        # coordinates of every rank.
        rows = chunk_rows(shape[0], mesh.size(shard_dims[0]))
        b, e = rows[mesh.get_local_rank(shard_dims[0])]
        pieces = [((r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + tuple(shape[1:]))
                  for r0, r1 in rows]
    else:
        pieces = _mesh_pieces(p, pg, shard_dims)
    offset, sizes = pieces[dist.get_rank(pg)]
    if tuple(loc.shape) != sizes or not loc.is_contiguous():
        raise ValueError("%s: its local tensor is %s%s, not the piece %s at %s torch's DTensor "
                         "gives this rank" % (what, tuple(loc.shape), "" if loc.is_contiguous()
                                              else " (non-contiguous)", sizes, offset))
    if all(tuple(s[1:]) == tuple(shape[1:]) for _, s in pieces):  # rows of the global tensor
        rows = [(o[0], o[0] + s[0]) for o, s in pieces]
        return ShardInfo(name, shape, 1, offset[0], offset[0] + sizes[0], pg, rg, rank_rows=rows)
    from .. import _C
    box = (tuple(shape), offset, sizes)
    width = sizes[1] if len(shape) == 2 else 0
    if width and all(s[1] == width and o[1] % width == 0 for o, s in pieces) \
            and shape[1] % width == 0:
        # Equal column blocks (torch's Shard(1) where tp divides the columns): rows of
        # the blocks one after another, as C++ describes them (TensorShard::col_parts).
        rows = [((o[1] // width) * shape[0] + o[0], (o[1] // width) * shape[0] + o[0] + s[0])
                for o, s in pieces]
        b, e = rows[dist.get_rank(pg)]
        return ShardInfo.of(_C.TensorShard.column_parts(name, shape, shape[1] // width, b, e, rows),
                            pg, rg, box=box)
    # Any other piece: rows of its column block, for the element-wise optimizers alone.
    block = _C.TensorShard(name, [shape[0]] + list(sizes[1:]), 1, offset[0], offset[0] + sizes[0], [])
    return ShardInfo.of(block, pg, rg, box=box)


def dtensor_shard(name: str, p) -> ShardInfo:
    """The ShardInfo of a DTensor parameter (cached on it): its global shape, this
    rank's piece and every rank's, the shard group and the replicate group
    (_mesh_shard's, for every mesh: FSDP2's 1-D Shard(0), HSDP's (Replicate(),
    Shard(0)), and tensor or expert parallelism on further dims)."""
    cached = getattr(p, "_rfsdp_dtensor_shard", None)
    if cached is not None:
        return cached
    what = "%s: parameter '%s' (a DTensor with placements %s over a %d-D mesh)" % (
        "optimizer", name, tuple(p.placements), p.device_mesh.ndim)
    info = _mesh_shard(name, p, what)
    p._rfsdp_dtensor_shard = info
    return info


def info_of(name: str, p) -> Optional[ShardInfo]:
    """fully_shard's ShardInfo, an FSDP2 parameter's, or None: a plain tensor, or a
    DTensor replicated along every dim (a tensor-parallel bias: the whole tensor on
    each rank, stepped alike, as DDP's; an optimizer built before fully_shard
    meets it so, and follows it to its shard)."""
    info = shard_info(p)
    if info is None and is_dtensor(p) and not is_replicated(p):
        info = dtensor_shard(name, p)
    return info


def is_replicated(p) -> bool:
    """A DTensor whose every placement is Replicate()."""
    return all(x.is_replicate() for x in p.placements)


def local_grad_of(p) -> Optional[torch.Tensor]:
    """p's gradient as this rank's tensor: a DTensor gradient's local piece, once in
    p's placements (a replicated parameter's Partial gradient is summed first: a
    collective over its mesh, so run before the step's agreement, on every rank)."""
    g = p.grad
    if g is None or not is_dtensor(g):
        return g
    if is_dtensor(p) and tuple(g.placements) != tuple(p.placements):
        g = g.redistribute(p.device_mesh, p.placements)
    return g._local_tensor
