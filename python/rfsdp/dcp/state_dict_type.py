"""What a torch state dict of sharded tensors holds, stated explicitly per model
and per optimizer (as FSDP1's state_dict_type): "sharded" (the default: each
tensor of the global shape holding only this rank's pieces, as DCP saves and
loads them) or "full" (plain tensors of the global shapes, gathered; on the CPU
with cpu_offload, on rank 0 alone with rank0_only)."""
import torch

KINDS = ("sharded", "full")


class StateDictType:
    def __init__(self, kind, cpu_offload, rank0_only, timeout_s):
        if kind not in KINDS:
            raise ValueError("set_state_dict_type: kind must be 'sharded' or 'full', got %r"
                             % (kind,))
        self.kind, self.cpu_offload, self.rank0_only = kind, bool(cpu_offload), bool(rank0_only)
        self.timeout_s = float(timeout_s)


DEFAULT = StateDictType("sharded", False, False, 300.0)


def set_state_dict_type(target, kind: str, *, cpu_offload: bool = True, rank0_only: bool = True,
                        timeout_s: float = 300.0) -> None:
    """What target.state_dict() returns, target a model (it and every sharded
    module in it) or an rfsdp optimizer: "sharded" (ShardedRows, optimizer
    states as DCP places them: this rank's part, with the global shape) or
    "full" (tensors of the global shapes; cpu_offload: on the CPU; rank0_only: on
    rank 0, the other ranks' dicts lack them). A full state dict is collective; a
    model's rank left alone in it fails after timeout_s seconds.
    torch.distributed.checkpoint's get_optimizer_state_dict(full_state_dict=True)
    of an rfsdp optimizer asks its state_dict(): set "full" first (and "sharded"
    after)."""
    settings = StateDictType(kind, cpu_offload, rank0_only, timeout_s)
    if isinstance(target, torch.optim.Optimizer):
        if not hasattr(target, "sharded_state"):
            raise ValueError("set_state_dict_type: %s is not one of rfsdp.optim's optimizers"
                             % type(target).__name__)
        target._rfsdp_state_dict = settings
        return
    found = False
    for m in target.modules():
        if getattr(m, "_rfsdp_unit", None) is not None:
            m._rfsdp_state_dict = settings
            found = True
    if not found:
        raise ValueError("set_state_dict_type: the model has no fully_shard modules")


def get_state_dict_type(target) -> str:
    """The kind set_state_dict_type set on a model or optimizer ("sharded" unless set)."""
    return state_dict_type(target).kind


def state_dict_type(target) -> StateDictType:
    return getattr(target, "_rfsdp_state_dict", None) or DEFAULT
