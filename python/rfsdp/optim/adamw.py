"""AdamW and AdamW8bit over the C++ optimizers (optimizers/adamw)."""
from .. import _C
from .base import _OverCpp, bool_option


class AdamW(_OverCpp):
    """torch.optim.AdamW's update over shards (or plain tensors). Collective: the
    NaN/Inf check agrees across process_group's ranks (default: the shard group of
    fully_shard's parameters, else torch.distributed's default group, else none),
    so every rank builds it and steps together. Over a (dp, tp) mesh (torch's
    tensor parallelism, then FSDP2 over dp) it steps every rank's piece and agrees
    over all the mesh's ranks.

    hyperball (a group option; AdamH, "Fantastic Pretraining Optimizers II"): the
    group's parameters of 2 or more dims keep their Frobenius norm R,
    hyperball_radius (None: the norm when the optimizer first steps them, kept
    in the state as "hyperball_radius", saved and resharded). With d = m^ /
    (sqrt(v^) + eps), AdamW's update before lr: u = d / (|d|_F + 1e-8), W <- W -
    lr R u, W <- R W / (|W|_F + 1e-8); the group's 0-D and 1-D parameters take
    plain AdamW. weight_decay must be 0 in such a group (an error otherwise).
    A parameter ranks cut needs |W|^2, <W, d> and |d|^2 summed across them: one
    float64 all-reduce a step for all of them (hyperball_bytes() says how many
    bytes this rank sent); one held whole needs none."""

    _takes_boxes = True  # (element-wise: any piece)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 process_group=None, timeout_seconds=300.0, rounding="nearest", hyperball=False,
                 hyperball_radius=None):
        self.rounding = rounding  # (checked in C++ when bound)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      hyperball=hyperball, hyperball_radius=hyperball_radius))
        self._set_groups(process_group, timeout_seconds)
        self._bind()

    _options_class = _C.AdamWOptions

    def _group_options(self, g):
        return dict(lr=g["lr"], betas=g["betas"], eps=g["eps"], weight_decay=g["weight_decay"],
                    hyperball=bool_option(type(self).__name__, g, "hyperball"),
                    hyperball_radius=g.get("hyperball_radius"))

    def hyperball_bytes(self):
        """Bytes this rank sent in the last step's all-reduce of Hyperball's sums
        (the parameters ranks cut; 0: none)."""
        self._bind()
        return self._impl.hyperball_bytes()

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
    all-reduce. On a GPU, shards must hold whole blocks. state_format: "dynamic"
    (None: the default, bitsandbytes' maps) or "float8_e4m3fn" (codes are e4m3
    bit patterns of the value times 448 / absmax, decoded and encoded by
    arithmetic; v never rounds a value above 0 to 0). rfsdp.checkpoint.load(...,
    requantize=True) moves a checkpoint between formats. hyperball: as AdamW's
    (d from the 8-bit moments)."""

    _config_class = _C.AdamW8bitConfig
    _takes_boxes = False  # (blocks of the global tensor's rows)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 block=None, min_8bit_size=None, process_group=None, timeout_seconds=300.0,
                 rounding="nearest", state_format=None, hyperball=False,
                 hyperball_radius=None):
        self.config = _C.AdamW8bitConfig(
            block=block if block is None or isinstance(block, int) else tuple(block),
            min_8bit_size=min_8bit_size, state_format=state_format)
        super().__init__(params, lr, betas, eps, weight_decay, process_group, timeout_seconds,
                         rounding, hyperball, hyperball_radius)

    def _make_impl(self, params):
        return _C.AdamW8bit(self._specs(params), self.config, self.comm)

    def shared_blocks(self):
        """Blocks this rank shares with other ranks (a shard boundary cuts them):
        their scales are agreed in one all-reduce a step; 0 means none."""
        self._bind()
        return self._impl.shared_blocks()
