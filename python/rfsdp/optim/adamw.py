"""AdamW and AdamW8bit over the C++ optimizers (optimizers/adamw)."""
from .. import _C
from .base import _OverCpp, _shard_spec
from .requantize import _row_span


def _adamw_options(g):
    return (g["lr"], *g["betas"], g["eps"], g["weight_decay"])

class AdamW(_OverCpp):
    """torch.optim.AdamW's update over shards (or plain tensors). Collective: the
    NaN/Inf check agrees across process_group's ranks (default: the shard group of
    fully_shard's parameters, else torch.distributed's default group, else none),
    so every rank builds it and steps together."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 process_group=None, timeout_seconds=300.0, rounding="nearest"):
        self.rounding = rounding  # (checked in C++ when bound)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._set_groups(process_group, timeout_seconds)
        self._bind()

    def _make(self, specs):
        return _C.AdamW(specs, self.comm)

    def _parts(self, params):
        self._impl = self._make([_shard_spec(i, p) for i, p in enumerate(params)])
        return [(self._impl, list(range(len(params))), _adamw_options)]


class AdamW8bit(AdamW):
    """AdamW with both moments as 8-bit block-wise codes (bitsandbytes' dynamic
    maps, one fp32 absmax per block). block: 256 (1-D blocks) or (32, 32) tiles.
    Tensors with fewer than min_8bit_size elements (the full tensor's size)
    keep fp32 moments. Blocks are the global tensor's, so codes and scales do not
    depend on the world size: a block that a shard boundary cuts (FSDP2's
    torch.chunk rows, or a plan without rfsdp.policy.blockwise_8bit(block)) is
    shared by its ranks, which agree its scale in one small all-reduce a step
    (for all such blocks). Plans made with that policy hold whole blocks: no
    all-reduce. On a GPU, shards must hold whole blocks."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 block=256, min_8bit_size=4096, process_group=None, timeout_seconds=300.0,
                 rounding="nearest"):
        self.block = block if isinstance(block, int) else tuple(block)
        self.min_8bit_size = min_8bit_size
        super().__init__(params, lr, betas, eps, weight_decay, process_group, timeout_seconds,
                         rounding)

    def _make(self, specs):
        return _C.AdamW8bit(specs, self.block, self.min_8bit_size, self.comm)

    def shared_blocks(self):
        """Blocks this rank shares with other ranks (a shard boundary cuts them):
        their scales are agreed in one all-reduce a step; 0 means none."""
        self._bind()
        return self._impl.shared_blocks()

    def settings(self):
        return dict(super().settings(), block=list(self.block) if isinstance(self.block, tuple)
                    else self.block, min_8bit_size=self.min_8bit_size)

    def requantized_state(self, p, saved_settings, full):
        """p's state under this optimizer's blocks from a checkpoint's full
        (unsharded) state of p, saved by an AdamW8bit with saved_settings (other
        blocks or min_8bit_size): the full moments (8-bit codes dequantised with
        the saved blocks, or fp32), this rank's rows, quantised with this
        optimizer's blocks (or kept fp32 where this one keeps them so): within
        one code of the saved values. For load_sharded_state."""
        rows, row_len, begin, end = _row_span(p)  # the rows the optimizer sees decide the blocks
        old_block = saved_settings["block"]
        old_block = tuple(old_block) if isinstance(old_block, list) else old_block
        live = self.sharded_state(p)
        spans = self.state_layout(p)
        out = {}
        for codes, scale, moment, signed in (("q1", "absmax1", "exp_avg", True),
                                             ("q2", "absmax2", "exp_avg_sq", False)):
            code = _C.dynamic_map(signed)
            if codes in full:
                whole = _C.dequantize_blockwise(full[codes], full[scale], code, old_block,
                                                row_len).reshape(rows, row_len)
            elif moment in full:
                whole = full[moment].reshape(rows, row_len)
            else:
                raise ValueError("no saved moments of a parameter of shape %s" % (tuple(p.shape),))
            if codes in live:  # the whole tensor's blocks, then this rank's codes and scales
                q, a = _C.quantize_blockwise(whole.contiguous(), code, self.block, row_len,
                                             keep_nonzero=not signed)
                _, _, first, _ = spans[scale]
                out[codes] = q.reshape(-1)[begin * row_len:end * row_len].clone()
                out[scale] = a.reshape(-1)[first:first + live[scale].numel()].clone()
            else:
                out[moment] = whole[begin:end].contiguous().reshape(live[moment].shape)
        out["step"] = full["step"]
        return out
