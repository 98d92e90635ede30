"""AdamW and AdamW8bit over the C++ optimizers (optimizers/adamw)."""
from .. import _C
from .base import _OverCpp


class AdamW(_OverCpp):
    """torch.optim.AdamW's update over shards (or plain tensors). Collective: the
    NaN/Inf check agrees across process_group's ranks (default: the shard group of
    fully_shard's parameters, else torch.distributed's default group, else none),
    so every rank builds it and steps together. Over a (dp, tp) mesh (torch's
    tensor parallelism, then FSDP2 over dp) it steps every rank's piece and agrees
    over all the mesh's ranks."""

    _takes_boxes = True  # (element-wise: any piece)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 process_group=None, timeout_seconds=300.0, rounding="nearest"):
        self.rounding = rounding  # (checked in C++ when bound)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._set_groups(process_group, timeout_seconds)
        self._bind()

    _options_class = _C.AdamWOptions

    def _group_options(self, g):
        return dict(lr=g["lr"], betas=g["betas"], eps=g["eps"], weight_decay=g["weight_decay"])

    def _make_impl(self, params):
        return _C.AdamW(self._specs(params), self.comm)


class AdamW8bit(AdamW):
    """AdamW with both moments as 8-bit block-wise codes (bitsandbytes' dynamic
    maps, one fp32 absmax per block). block: an int (1-D blocks of that many
    elements) or (rows, cols) tiles; None: 256. Tensors with fewer than
    min_8bit_size elements (the full tensor's size; None: 4096) keep fp32
    moments (the defaults are the C++ AdamW8bitConfig's). Blocks are the global tensor's, so codes and scales do not
    depend on the world size: a block that a shard boundary cuts (FSDP2's
    torch.chunk rows, or a plan without rfsdp.policy.blockwise_8bit(block)) is
    shared by its ranks, which agree its scale in one small all-reduce a step
    (for all such blocks). Plans made with that policy hold whole blocks: no
    all-reduce. On a GPU, shards must hold whole blocks."""

    _config_class = _C.AdamW8bitConfig
    _takes_boxes = False  # (blocks of the global tensor's rows)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 block=None, min_8bit_size=None, process_group=None, timeout_seconds=300.0,
                 rounding="nearest"):
        self.config = _C.AdamW8bitConfig(
            block=block if block is None or isinstance(block, int) else tuple(block),
            min_8bit_size=min_8bit_size)
        super().__init__(params, lr, betas, eps, weight_decay, process_group, timeout_seconds,
                         rounding)

    def _make_impl(self, params):
        return _C.AdamW8bit(self._specs(params), self.config, self.comm)

    def shared_blocks(self):
        """Blocks this rank shares with other ranks (a shard boundary cuts them):
        their scales are agreed in one all-reduce a step; 0 means none."""
        self._bind()
        return self._impl.shared_blocks()
