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
    model's rank left alone in it fails after timeout_s seconds. Unset, torch's
    get_model_state_dict / get_optimizer_state_dict give what their options ask
    (state_dict_type below)."""
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
    return (getattr(target, "_rfsdp_state_dict", None) or DEFAULT).kind


# The torch.distributed.checkpoint.state_dict functions that ask a model's and an
# optimizer's state_dict() with their options in a local named `info`.
_TORCH_CALLERS = {"model": "_get_model_state_dict", "optimizer": "_get_optim_state_dict"}


def state_dict_type(target) -> StateDictType:
    """What target.state_dict() returns now: the kind set_state_dict_type set;
    else, inside torch's get_model_state_dict / get_optimizer_state_dict with
    full_state_dict=True, "full" (cpu_offload and rank 0 only as its cpu_offload
    says, as torch does for FSDP2); else "sharded". torch passes its options to
    neither a model's state_dict() nor an optimizer's and has no hook for tensors
    that are not DTensors, so this is the one place rfsdp reads its caller's frames
    (without it, torch's full optimizer state dict would hold sharded pieces)."""
    explicit = getattr(target, "_rfsdp_state_dict", None)
    if explicit is not None:
        return explicit
    caller = _TORCH_CALLERS["optimizer" if isinstance(target, torch.optim.Optimizer) else "model"]
    import sys
    f = sys._getframe(1)
    for _ in range(12):
        if f is None:
            break
        if f.f_code.co_name == caller and \
                f.f_globals.get("__name__") == "torch.distributed.checkpoint.state_dict":
            info = f.f_locals.get("info")
            if info is not None and info.full_state_dict:
                return StateDictType("full", bool(info.cpu_offload), bool(info.cpu_offload),
                                     DEFAULT.timeout_s)
            break
        f = f.f_back
    return DEFAULT
