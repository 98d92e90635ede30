"""rfsdp.optim: AdamW, AdamW8bit and Muon as torch.optim.Optimizer subclasses
over the C++ kernels. Parameters are the shards fully_shard made (or plain
tensors); param_groups, zero_grad, state_dict/load_state_dict and LR schedulers
work as with torch.optim.AdamW. Shampoo comes with its issue."""
import torch
import torch.distributed as dist

from . import _C
from ._comm import make_comm
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
    if info is None:  # a whole tensor: rows of its first dim, as fully_shard's default
        rows, row_len = _C.row_geometry(list(p.shape), 1)
        return rows, row_len, 0, p.numel()
    return info.full_rows, info.row_len, info.row_begin, info.full_rows * info.row_len


def _default_comm(process_group, timeout_seconds):
    """The Comm an optimizer's cross-rank checks (and Muon's gathers) run over:
    the given group, else torch.distributed's default group, else none (one process)."""
    if process_group is None and dist.is_available() and dist.is_initialized():
        process_group = dist.group.WORLD
    return None if process_group is None else make_comm(process_group, timeout_seconds)


def _check_all_finite(name, comm, grads):
    """Every rank agrees (one all-reduce of a flag) before any state changes: a
    rank that raised alone would leave the others waiting in the next collective."""
    if not _C.all_ranks_finite(comm, grads):
        raise RuntimeError("%s: a gradient on some rank holds NaN or Inf; the step was not taken "
                           "on any rank (check the loss, lower the learning rate, or clip "
                           "gradients)" % name)


def _run_closure(closure):
    """torch.optim's contract: step(closure) re-evaluates the loss with grad enabled."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class _LoadsCopies:
    """torch 2.x's Optimizer.load_state_dict keeps the given state tensors (no
    copy). These optimizers update their state in place, so loading a live
    optimizer's state_dict would share (and advance twice) its state: load copies."""

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        state_dict["state"] = {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
                               for k, s in state_dict["state"].items()}
        super().load_state_dict(state_dict)


def _check_grad_layout(name, g):
    if g.dtype != torch.float32 or not g.is_contiguous():
        raise ValueError("%s: gradients must be contiguous float32" % name)


def _adam_state_step(p, state, init_state):
    """Creates the state at the first step; counts the step."""
    if not state:
        state["step"] = torch.tensor(0.0)
        init_state(p, state)
    state["step"] += 1


def _init_adam_state(p, state):
    state["exp_avg"] = torch.zeros_like(p)
    state["exp_avg_sq"] = torch.zeros_like(p)


def _adamw_update(p, state, group):
    b1, b2 = group["betas"]
    _C.adamw_step(p.data, p.grad, state["exp_avg"], state["exp_avg_sq"], group["lr"], b1, b2,
                  group["eps"], group["weight_decay"], int(state["step"]))


class AdamW(_LoadsCopies, torch.optim.Optimizer):
    """torch.optim.AdamW's update over shards (or plain tensors). Collective: the
    NaN/Inf check agrees across process_group's ranks (default: torch.distributed's
    default group, none without one), so every rank builds it and steps together."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 process_group=None, timeout_seconds=300.0):
        if lr < 0 or eps <= 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or weight_decay < 0:
            raise ValueError("AdamW: need lr >= 0, eps > 0, 0 <= betas < 1, weight_decay >= 0")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        _check_params(type(self).__name__, self.param_groups)
        self.comm = _default_comm(process_group, timeout_seconds)

    def _init_state(self, p, state):
        _init_adam_state(p, state)

    def _update(self, p, state, group):
        _adamw_update(p, state, group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = _run_closure(closure)
        live = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        for p, _ in live:
            _check_grad_layout(type(self).__name__, p.grad)
        _check_all_finite(type(self).__name__, self.comm, [p.grad for p, _ in live])
        for p, group in live:
            _adam_state_step(p, self.state[p], self._init_state)
            self._update(p, self.state[p], group)
        return loss


class AdamW8bit(AdamW):
    """AdamW with both moments as 8-bit block-wise codes (bitsandbytes' dynamic
    maps, one fp32 absmax per block). block: 256 (1-D blocks) or (32, 32) tiles.
    Tensors with fewer than min_8bit_size elements (the full tensor's size)
    keep fp32 moments. Shards must hold whole blocks: plan with
    rfsdp.policy.blockwise_8bit(block)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 block=256, min_8bit_size=4096, process_group=None, timeout_seconds=300.0):
        super().__init__(params, lr, betas, eps, weight_decay, process_group, timeout_seconds)
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


class Muon(_LoadsCopies, torch.optim.Optimizer):
    """Muon over ragged shards, with AdamW for the parameters outside Muon groups
    (as the reference Muon's MuonWithAuxAdam): groups with use_muon=False take
    AdamW's lr, betas, eps and weight_decay (defaults 3e-4, (0.9, 0.95), 1e-10, 0).

    Each step: momentum on the local shard; every matrix's update gathered to its
    root rank (one all-to-all), orthogonalised there by Newton–Schulz, scattered
    back (one all-to-all); p <- p (1 - lr wd) - lr o. Matrices: 2-D weights; a 3-D
    [E, H, I] expert stack is E matrices H x I; more dims are (dim 0, rest). A 0-D
    or 1-D parameter in a Muon group is an error. adjust_lr: "original" scales
    the update by max(1, rows/cols)^0.5; "match_rms_adamw" by 0.2 sqrt(max(rows,
    cols)) (Moonlight; reuse AdamW's lr and weight decay). ns_dtype: Newton–Schulz
    compute dtype (float32; bfloat16 is the usual choice on GPU).

    Collective: every rank builds it from the same model and steps together;
    process_group defaults to torch.distributed's default group (none: one process).
    """

    AUX_DEFAULTS = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)
    ADJUST_LR = ("original", "match_rms_adamw")

    def __init__(self, param_groups, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5,
                 weight_decay=0.0, adjust_lr="original", process_group=None,
                 ns_dtype=torch.float32, timeout_seconds=300.0):
        groups = list(param_groups)
        if groups and not isinstance(groups[0], dict):
            groups = [dict(params=groups)]
        groups = [dict(g) for g in groups]
        for g in groups:
            g.setdefault("use_muon", True)
            if not g["use_muon"]:
                for k, v in self.AUX_DEFAULTS.items():
                    g.setdefault(k, v)
        super().__init__(groups, dict(lr=lr, momentum=momentum, nesterov=nesterov,
                                      ns_steps=ns_steps, weight_decay=weight_decay,
                                      adjust_lr=adjust_lr, use_muon=True))
        _check_params(type(self).__name__, self.param_groups)
        for g in self.param_groups:
            if g["use_muon"]:
                if g["adjust_lr"] not in self.ADJUST_LR:
                    raise ValueError("Muon: adjust_lr must be one of %s, got %r"
                                     % (self.ADJUST_LR, g["adjust_lr"]))
                if not (0 <= g["momentum"] < 1) or g["lr"] < 0 or g["weight_decay"] < 0:
                    raise ValueError("Muon: need 0 <= momentum < 1, lr >= 0, weight_decay >= 0")
                if isinstance(g["ns_steps"], bool) or not isinstance(g["ns_steps"], int) \
                        or g["ns_steps"] < 1:
                    raise ValueError("Muon: ns_steps must be a positive integer")
        if ns_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("Muon: ns_dtype must be torch.float32 or torch.bfloat16")
        self.ns_dtype = str(ns_dtype).replace("torch.", "")
        # The Comm, not the group object: rfsdp closes its Comms at exit (see _comm).
        self.comm = _default_comm(process_group, timeout_seconds)
        self.layout = self._build_layout()

    def _muon_params(self):
        return [(p, g) for g in self.param_groups if g["use_muon"] for p in g["params"]]

    def _build_layout(self):
        geo = []
        for i, (p, g) in enumerate(self._muon_params()):
            info = shard_info(p)
            if info is None:
                geo.append(("param %d" % i, list(p.shape), 0, p.numel(), g["ns_steps"]))
            else:
                geo.append((info.name, list(info.global_shape), info.row_begin * info.row_len,
                            info.row_end * info.row_len, g["ns_steps"]))
        return _C.Muon(self.comm, geo)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        if getattr(self, "layout", None) is not None:  # a group added later: lay out again
            _check_params(type(self).__name__, self.param_groups)
            self.layout = self._build_layout()

    @torch.no_grad()
    def step(self, closure=None):
        loss = _run_closure(closure)
        muon = self._muon_params()
        for p, _ in muon:  # a rank without a gradient still takes part in the collectives
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        aux = [(p, g) for g in self.param_groups if not g["use_muon"] for p in g["params"]
               if p.grad is not None]
        grads = [p.grad for p, _ in muon + aux]
        for g in grads:
            _check_grad_layout(type(self).__name__, g)
        _check_all_finite(type(self).__name__, self.comm, grads)
        moms = []
        for p, _ in muon:
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p)
            moms.append(state["momentum_buffer"])
        hyper = [(g["lr"], g["momentum"], g["weight_decay"], bool(g["nesterov"]), g["adjust_lr"])
                 for _, g in muon]
        self.layout.step([p.data for p, _ in muon], [p.grad for p, _ in muon], moms, hyper,
                         self.ns_dtype)
        for p, group in aux:
            _adam_state_step(p, self.state[p], _init_adam_state)
            _adamw_update(p, self.state[p], group)
        return loss
