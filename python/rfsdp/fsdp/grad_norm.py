"""Norms of sharded gradients are global, so torch's own clip_grad_norm_ and
get_total_norm clip by the norm of the whole model, as under FSDP2.

A shard's .grad is a ShardGrad: a plain tensor of this rank's rows whose norms
(torch.linalg.vector_norm, torch._foreach_norm, Tensor.norm, torch.norm over all
elements) return a PartialNorm: this rank's part of a norm, combined across the
shard group when used. torch's get_total_norm stacks the per-tensor norms and
takes their norm: that combination is one all-reduce per shard group (a scalar),
whatever the number of tensors. Any other use of a PartialNorm (arithmetic,
.item(), printing) resolves it first (one all-reduce per group), so it is a
collective: every rank of the group must do it, as with FSDP2's DTensor norms.
Every other operation on a ShardGrad is the plain tensor operation on the local
rows (sum, max, numel: local), returning plain tensors.

Chosen over DTensor: a DTensor's Shard(0) means torch.chunk's equal split, which
ragged rows are not (torch 2.11 has no custom placements), and a DTensor
parameter would put every optimizer and module operation through DTensor's
dispatch. This type costs only its norms: measured in bench/fsdp2_habits.py (clipping)."""
import math
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

_plain = torch._C._disabled_torch_function_impl
_NORMS = {torch.linalg.vector_norm, torch._foreach_norm, torch.Tensor.norm, torch.norm}


class ShardGrad(torch.Tensor):
    """The gradient of a sharded parameter: this rank's rows (see the module)."""

    _rfsdp_group: Any = None

    @staticmethod
    def of(t: torch.Tensor, group) -> "ShardGrad":
        g = t.as_subclass(ShardGrad)
        g._rfsdp_group = group
        return g

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _NORMS:
            out = _partial_norms(func, args, kwargs or {})
            if out is not None:
                return out
        # Everything else: the plain operation, plain results (in C++).
        return _plain(func, types, args, kwargs or {})

    def __repr__(self, **kwargs):
        with torch._C.DisableTorchFunctionSubclass():
            return "ShardGrad(local rows: %s)" % torch.Tensor.__repr__(self, **kwargs)


def _ord(func, args, kwargs):
    """The p of a norm over all elements, or None (a norm over some dims: local)."""
    if func is torch._foreach_norm:
        p = args[1] if len(args) > 1 else kwargs.get("ord", 2)
        return float(p)
    if func is torch.linalg.vector_norm:
        p = args[1] if len(args) > 1 else kwargs.get("ord", 2)
        dim = args[2] if len(args) > 2 else kwargs.get("dim", None)
    else:  # Tensor.norm / torch.norm(input, p="fro", dim=None, ...)
        p = args[1] if len(args) > 1 else kwargs.get("p", "fro")
        dim = args[2] if len(args) > 2 else kwargs.get("dim", None)
        p = 2 if p in ("fro", None) else p
    if dim is not None or isinstance(p, str):
        return None
    return float(p)


def _check_ord(p):
    if not (p == math.inf or 0 < p < math.inf):
        raise NotImplementedError(
            "rfsdp: the %s-norm of sharded gradients is not supported (only p > 0 and inf "
            "combine across ranks); use norm_type=2 or inf" % p)


def _local_norm(g, p, dtype=None):
    with torch._C.DisableTorchFunctionSubclass():
        if g.numel() == 0:  # a rank may hold no rows of a tensor
            return torch.zeros((), dtype=dtype or g.dtype, device=g.device)
        return torch.linalg.vector_norm(g, p, dtype=dtype)


def _partial_norms(func, args, kwargs):
    p = _ord(func, args, kwargs)
    if p is None:
        return None
    _check_ord(p)
    dtype = kwargs.get("dtype")
    if func is torch._foreach_norm:
        return [PartialNorm.of(_local_norm(g, p, dtype), p, g._rfsdp_group)
                if isinstance(g, ShardGrad) else _local_norm(g, p, dtype) for g in args[0]]
    g = args[0]
    if kwargs.get("keepdim") or (len(args) > 3 and args[3]):
        return None
    return PartialNorm.of(_local_norm(g, p, dtype), p, g._rfsdp_group)


class PartialNorm(torch.Tensor):
    """This rank's part of p-norms of sharded tensors (0-d, or a stack of them):
    element i is combined over parts[i] = (p, group), or is whole already (None)."""

    parts: list = []

    @staticmethod
    def of(local: torch.Tensor, p: float, group, parts: Optional[list] = None) -> "PartialNorm":
        out = local.as_subclass(PartialNorm)
        out.parts = parts if parts is not None else [(p, group)]
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and isinstance(args[0], PartialNorm):
            with torch._C.DisableTorchFunctionSubclass():
                local = func(*args, **kwargs)
            return PartialNorm.of(local, 0, None, args[0].parts)
        if func is torch.stack and _stackable(args, kwargs):
            return _stack(args[0])
        if func is torch.linalg.vector_norm and isinstance(args[0], PartialNorm):
            total = _total(args, kwargs)
            if total is not None:
                return total
        args, kwargs = pytree.tree_map_only(PartialNorm, PartialNorm.resolve, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def resolve(self) -> torch.Tensor:
        """The whole norms (plain tensor): one all-reduce per group (collective)."""
        with torch._C.DisableTorchFunctionSubclass():
            local = self.reshape(-1).to(torch.float64)
            out = local.clone()
            for (p, group), idx in _by_group(self.parts).items():
                sel = torch.tensor(idx, device=local.device)
                if p == math.inf:
                    part = local[sel].clone()
                    dist.all_reduce(part, op=dist.ReduceOp.MAX, group=group)
                else:
                    part = local[sel].pow(p)
                    dist.all_reduce(part, group=group)
                    part = part.pow(1.0 / p)
                out[sel] = part
            return out.to(self.dtype).reshape(self.shape)

    def __repr__(self, **kwargs):
        return "PartialNorm(%s)" % repr(self.resolve())


def _by_group(parts):
    out = {}
    for i, part in enumerate(parts):
        if part is not None:
            out.setdefault(part, []).append(i)
    return out


def _stackable(args, kwargs):
    xs = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    with torch._C.DisableTorchFunctionSubclass():  # metadata, not a use of the values
        return dim == 0 and "out" not in kwargs and \
            all(isinstance(x, torch.Tensor) and x.dim() == 0 for x in xs)


def _stack(xs):
    parts = []
    for x in xs:
        parts.append(x.parts[0] if isinstance(x, PartialNorm) else None)
    with torch._C.DisableTorchFunctionSubclass():
        local = torch.stack([torch.Tensor.as_subclass(x, torch.Tensor) for x in xs])
    return PartialNorm.of(local, 0, None, parts)


def _total(args, kwargs):
    """The norm of a stack of partial norms with the same p over all elements: one
    all-reduce of a scalar per group. None when the call is of another kind."""
    x = args[0]
    p = float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    dim = args[2] if len(args) > 2 else kwargs.get("dim", None)
    with torch._C.DisableTorchFunctionSubclass():
        ndim = x.dim()
    if dim is not None or kwargs.get("dtype") is not None or ndim != 1 or \
            any(part is not None and part[0] != p for part in x.parts):
        return None
    _check_ord(p)
    with torch._C.DisableTorchFunctionSubclass():
        local = x.to(torch.float64)
        groups = _by_group(x.parts)
        whole = [i for i, part in enumerate(x.parts) if part is None]
        if p == math.inf:
            acc = local[whole].max() if whole else torch.zeros((), dtype=torch.float64,
                                                              device=local.device)
            for (_, group), idx in groups.items():
                part = local[idx].max()
                dist.all_reduce(part, op=dist.ReduceOp.MAX, group=group)
                acc = torch.maximum(acc, part)
            return acc.to(x.dtype)
        acc = local[whole].pow(p).sum()
        for (_, group), idx in groups.items():
            part = local[idx].pow(p).sum()
            dist.all_reduce(part, group=group)
            acc = acc + part
        return acc.pow(1.0 / p).to(x.dtype)
