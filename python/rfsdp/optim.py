"""rfsdp.optim: AdamW and AdamW8bit as torch.optim.Optimizer subclasses over
the C++ kernels. Parameters are the shards fully_shard made (or plain tensors);
param_groups, zero_grad, state_dict/load_state_dict and LR schedulers work as
with torch.optim.AdamW. Muon and Shampoo come with their issues."""
import torch

from . import _C
from .fsdp import shard_info


def _check_params(optimizer_name, params):
    for group in params:
        for p in group["params"]:
            replaced = getattr(p, "_rfsdp_replaced", None)
            if replaced is not None:
                raise ValueError(
                    "%s: parameter '%s' was replaced by fully_shard; build the optimizer after "
                    "fully_shard, from model.parameters()" % (optimizer_name, replaced))
            if p.dtype != torch.float32 or p.device.type != "cpu" or not p.is_contiguous():
                raise ValueError("%s: parameters must be contiguous float32 CPU tensors, got %s on %s"
                                 % (optimizer_name, p.dtype, p.device))


def _rows(p):
    """(full_rows, row_len, row_begin, full numel) of a parameter or shard."""
    info = shard_info(p)
    if info is None:
        row_len = p.shape[-1] if p.dim() >= 2 else 1
        rows = p.numel() // row_len if row_len else 0
        return rows, row_len, 0, p.numel()
    return info.full_rows, info.row_len, info.row_begin, info.full_rows * info.row_len


def _check_grad(name, g):
    if not _C.all_finite(g):
        raise RuntimeError("%s: a gradient holds NaN or Inf; the step was not taken (check the loss, "
                           "lower the learning rate, or clip gradients)" % name)


class AdamW(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        if lr < 0 or eps <= 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or weight_decay < 0:
            raise ValueError("AdamW: need lr >= 0, eps > 0, 0 <= betas < 1, weight_decay >= 0")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        _check_params(type(self).__name__, self.param_groups)

    def _init_state(self, p, state):
        state["exp_avg"] = torch.zeros_like(p)
        state["exp_avg_sq"] = torch.zeros_like(p)

    def _update(self, p, state, group):
        b1, b2 = group["betas"]
        _C.adamw_step(p.data, p.grad, state["exp_avg"], state["exp_avg_sq"], group["lr"], b1, b2,
                      group["eps"], group["weight_decay"], int(state["step"]))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        live = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        for p, _ in live:
            if p.grad.dtype != torch.float32 or not p.grad.is_contiguous():
                raise ValueError("%s: gradients must be contiguous float32" % type(self).__name__)
            _check_grad(type(self).__name__, p.grad)  # before any state changes
        for p, group in live:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                self._init_state(p, state)
            state["step"] += 1
            self._update(p, state, group)
        return loss


class AdamW8bit(AdamW):
    """AdamW with both moments as 8-bit block-wise codes (bitsandbytes' dynamic
    maps, one fp32 absmax per block). block: 256 (1-D blocks) or (32, 32) tiles.
    Tensors with fewer than min_8bit_size elements (the full tensor's size)
    keep fp32 moments. Shards must hold whole blocks: plan with
    rfsdp.policy.blockwise_8bit(block)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 block=256, min_8bit_size=4096):
        super().__init__(params, lr, betas, eps, weight_decay)
        self.block = block if isinstance(block, int) else tuple(block)
        self.min_8bit_size = min_8bit_size
        self.code1 = _C.dynamic_map(True)
        self.code2 = _C.dynamic_map(False)
        for g in self.param_groups:  # refuse shards that cut blocks now, not at the first step
            for p in g["params"]:
                self._check_blocks(p)

    def _check_blocks(self, p):
        rows, row_len, begin, full_numel = _rows(p)
        if full_numel < self.min_8bit_size:
            return
        name = shard_info(p).name if shard_info(p) else "?"
        try:
            _C.check_whole_blocks(self.block, name, rows, row_len, begin,
                                  p.numel() // row_len if row_len else 0)
        except ValueError as e:
            raise ValueError("AdamW8bit: %s" % e) from None

    def _init_state(self, p, state):
        rows, row_len, _, full_numel = _rows(p)
        if full_numel < self.min_8bit_size:
            return super()._init_state(p, state)
        n_blocks = _C.num_blocks(self.block, p.numel() // row_len, row_len)
        state["q1"] = torch.full((p.numel(),), _C.nearest_code(self.code1, 0.0), dtype=torch.uint8)
        state["q2"] = torch.full((p.numel(),), _C.nearest_code(self.code2, 0.0), dtype=torch.uint8)
        state["absmax1"] = torch.zeros(n_blocks)
        state["absmax2"] = torch.zeros(n_blocks)

    def _update(self, p, state, group):
        if "q1" not in state:
            return super()._update(p, state, group)
        b1, b2 = group["betas"]
        _, row_len, _, _ = _rows(p)
        _C.adamw8bit_step(p.data, p.grad, state["q1"], state["absmax1"], state["q2"],
                          state["absmax2"], self.block, row_len, self.code1, self.code2,
                          group["lr"], b1, b2, group["eps"], group["weight_decay"],
                          int(state["step"]))
