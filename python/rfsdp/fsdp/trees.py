"""The tensors in a unit's inputs and outputs, found with torch.utils._pytree (as
FSDP2 does): lists, tuples, namedtuples, dicts, transformers' ModelOutput, and
whatever else is registered with pytree. A dataclass pytree does not know is
registered on first sight (its fields are its children); any other object a
tensor could hide in is refused loudly: a tensor skipped would get no backward
hook, and its unit's gradients would silently be wrong."""
import dataclasses
from typing import Any, Iterator

import torch
import torch.utils._pytree as pytree

_PLAIN = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device,
          torch.Size, slice, type(Ellipsis), torch.memory_format, torch.layout)


def _register_dataclass(cls: type) -> None:
    names = [f.name for f in dataclasses.fields(cls)]
    if not all(f.init for f in dataclasses.fields(cls)):
        raise TypeError("rfsdp: a %s (a dataclass with fields that __init__ does not take) "
                        "passes through a sharded module; register it with "
                        "torch.utils._pytree.register_pytree_node so its tensors are found"
                        % cls.__qualname__)
    pytree.register_pytree_node(
        cls, lambda x: ([getattr(x, n) for n in names], None),
        lambda children, _ctx: cls(**dict(zip(names, children))),
        serialized_type_name="%s.%s" % (cls.__module__, cls.__qualname__))


def _holds_tensor(x: Any) -> bool:
    try:
        values = vars(x).values()
    except TypeError:
        return False
    return any(isinstance(v, torch.Tensor) for v in values)


def flatten(tree: Any) -> tuple:
    """(leaves, spec) of tree; unknown dataclasses are registered first."""
    while True:
        leaves, spec = pytree.tree_flatten(tree)
        new = {type(x) for x in leaves
               if dataclasses.is_dataclass(x) and not isinstance(x, type)}
        if not new:
            break
        for cls in new:
            _register_dataclass(cls)
    for x in leaves:
        if not isinstance(x, (torch.Tensor,) + _PLAIN) and _holds_tensor(x):
            raise TypeError(
                "rfsdp: a %s holding tensors passes through a sharded module, and "
                "torch.utils._pytree cannot see inside it; register it with "
                "torch.utils._pytree.register_pytree_node (or return a tuple, dict or "
                "dataclass) so its tensors get the unit's backward hooks" % type(x).__qualname__)
    return leaves, spec


def tensors(tree: Any) -> Iterator[torch.Tensor]:
    leaves, _ = flatten(tree)
    return (x for x in leaves if isinstance(x, torch.Tensor))


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """tree with every floating-point tensor cast to dtype (structure rebuilt by pytree)."""
    leaves, spec = flatten(tree)
    return pytree.tree_unflatten(
        [x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
         for x in leaves], spec)
