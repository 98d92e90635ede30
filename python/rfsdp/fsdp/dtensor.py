"""Parameters sharded by torch's FSDP2 as ragged shards: a DTensor Shard(0) over a
1-D mesh (FSDP), or (Replicate(), Shard(0)) over a 2-D mesh (HSDP), holds on each
rank the rows torch.chunk gives it: rows [r*c, min((r+1)*c, n)) with
c = ceil(n / m), possibly none. That is a ragged shard with every rank's rows
known, so rfsdp's optimizers take FSDP2's parameters (and DTensor gradients) as
they take fully_shard's, and update the local tensors in place."""
from typing import Optional

import torch

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


def dtensor_shard(name: str, p) -> ShardInfo:
    """The ShardInfo of an FSDP2 parameter (cached on it): its global shape, this
    rank's chunk rows and every rank's, the shard group and the replicate group."""
    cached = getattr(p, "_rfsdp_dtensor_shard", None)
    if cached is not None:
        return cached
    from torch.distributed.tensor import Replicate, Shard
    mesh, placements = p.device_mesh, tuple(p.placements)
    what = "%s: parameter '%s' (a DTensor with placements %s over a %d-D mesh)" % (
        "optimizer", name, placements, mesh.ndim)
    if mesh.ndim == 1 and placements == (Shard(0),):
        pg, rg, dim = mesh.get_group(0), None, 0
    elif mesh.ndim == 2 and placements == (Replicate(), Shard(0)):
        pg, rg, dim = mesh.get_group(1), mesh.get_group(0), 1
    elif all(isinstance(x, Replicate) for x in placements):
        raise ValueError("%s is replicated, not sharded: shard it with Shard(0), or give it to "
                         "an optimizer of its own as a plain tensor" % what)
    else:
        raise ValueError(
            "%s: rfsdp's optimizers take FSDP2's layouts, Shard(0) over a 1-D mesh or "
            "(Replicate(), Shard(0)) over a 2-D mesh (HSDP); other placements (Shard(1), a "
            "tensor-parallel mesh dimension) are not supported" % what)
    shape = list(p.shape)
    if not shape:
        raise ValueError("%s is 0-D: nothing to shard" % what)
    world, rank = mesh.size(dim), mesh.get_local_rank(dim)
    rows = chunk_rows(shape[0], world)
    b, e = rows[rank]
    loc = p._local_tensor
    if list(loc.shape) != [e - b] + shape[1:] or not loc.is_contiguous():
        raise ValueError("%s: its local tensor is %s%s, not the rows [%d, %d) torch.chunk "
                         "gives this rank" % (what, tuple(loc.shape),
                                              "" if loc.is_contiguous() else " (non-contiguous)",
                                              b, e))
    info = ShardInfo(name, shape, 1, b, e, pg, rg, rank_rows=rows)
    p._rfsdp_dtensor_shard = info
    return info


def info_of(name: str, p) -> Optional[ShardInfo]:
    """fully_shard's ShardInfo, an FSDP2 parameter's, or None (a plain tensor)."""
    info = shard_info(p)
    if info is None and is_dtensor(p):
        info = dtensor_shard(name, p)
    return info
