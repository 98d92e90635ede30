"""rfsdp.optim: AdamW, AdamW8bit, Muon, Shampoo and SOAP as torch.optim.Optimizer
subclasses over the C++ optimizers (optimizers/). Parameters are the shards
fully_shard made, FSDP2's DTensors, or plain tensors (replicated on every rank
under DDP); float32, bfloat16 or float16 (states and the update in float32,
written back rounded: rounding="nearest" or "stochastic"). Python keeps what is
Python's: param groups (each step hands every parameter its group's
hyperparameters), LR schedulers, and state_dict / load_state_dict in torch's
format, whose tensors are the C++ optimizer's own."""
import json

import torch
import torch.distributed as dist

from . import _C
from ._comm import make_comm
from .fsdp.dtensor import info_of, is_dtensor, local
from .fsdp.state_dict import Pieces, dcp_caller_options
from .state_layout import default_group, dcp_value, full_tensors, place_sequences, placements, \
    state_entries


def _check_params(optimizer_name, params):
    for group in params:
        for p in group["params"]:
            replaced = getattr(p, "_rfsdp_replaced", None)
            if replaced is not None:
                raise ValueError(
                    "%s: parameter '%s' was replaced by fully_shard; build the optimizer after "
                    "fully_shard, from model.parameters()" % (optimizer_name, replaced))


def _shard_spec(i, p):
    """What the C++ optimizers take for a parameter: (its shard descriptor, this
    rank's tensor): fully_shard's shard, an FSDP2 DTensor's local rows (see
    fsdp/dtensor.py), or a plain tensor as its own whole shard."""
    info = info_of("param %d" % i, p)
    if info is None:
        return (_C.TensorShard.whole("param %d" % i, list(p.shape)), p.data)
    return (info.shard, local(p.data))


def _tensor_keys(params):
    """What identifies the tensor each parameter holds now: (address, dtype, device)."""
    return [(t.data_ptr(), t.dtype, t.device) for t in map(local, params)]


def _default_comm(process_group, timeout_seconds, param_groups):
    """The Comm an optimizer's cross-rank checks (and Muon's gathers) run over:
    the given group, else the shard group of the parameters fully_shard (or FSDP2) made (one
    for all: under HSDP every replica steps alike, with nothing across replicas),
    else torch.distributed's default group, else none (one process)."""
    if process_group is None:
        shard_groups = {}
        params = [p for g in param_groups for p in g["params"]]
        for i, p in enumerate(params):
            info = info_of("param %d" % i, p)
            if info is not None and info.process_group is not None:
                key = tuple(dist.get_process_group_ranks(info.process_group))
                shard_groups.setdefault(key, (info.process_group, info.name))
        if len(shard_groups) > 1:
            (_, a), (_, b) = list(shard_groups.values())[:2]
            raise ValueError("optimizer: parameters '%s' and '%s' are sharded over different "
                             "process groups; build one optimizer per group, or pass "
                             "process_group" % (a, b))
        if shard_groups:
            process_group = next(iter(shard_groups.values()))[0]
    if process_group is None and dist.is_available() and dist.is_initialized():
        process_group = dist.group.WORLD
    return None if process_group is None else make_comm(process_group, timeout_seconds)


def _run_closure(closure):
    """torch.optim's contract: step(closure) re-evaluates the loss with grad enabled."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _agreed(impl, prepare):
    """Runs prepare() (this rank's part of a step before its first collective). If
    it raises, this rank runs the step's collectives with the error (impl's
    step_refused), as the other ranks' impl.step() runs them, so every rank
    raises the same error at once (naming this rank) instead of waiting for this
    one in a collective."""
    try:
        prepare()
    except (ValueError, TypeError, RuntimeError, IndexError) as e:
        impl.step_refused("%s: %s" % (type(e).__name__, e),
                          isinstance(e, (ValueError, TypeError, IndexError)))
        raise  # not reached: the step raised


def _adamw_options(g):
    return (g["lr"], *g["betas"], g["eps"], g["weight_decay"])


class _Part:
    """One C++ optimizer over some of the parameters: their indices, options(group)
    (a group's hyperparameters as its set_group_options takes them), the groups
    it holds and the options it was last sent."""

    def __init__(self, impl, idx, options, groups):
        self.impl, self.idx, self.options = impl, idx, options
        self.groups = sorted(set(groups))
        self.sent = {}
        self.has_step = [impl.state_has_step(k) for k in range(len(idx))]


class _OverCpp(torch.optim.Optimizer):
    """The C++ optimizer(s) over param_groups' parameters: built at construction
    (shards and options are checked then, in C++), rebuilt with the state carried
    over when a group is added. Each C++ optimizer knows every parameter's group;
    a group's options cross to it only when they change (an LR scheduler), and a
    step's gradients cross in one call. self.state[p] is torch's format and holds
    the C++ tensors themselves: {"step": counted steps, name: tensor, ...},
    present once p stepped.

    Like torch.optim, each step works on the tensors the parameters hold then:
    a parameter whose storage was replaced since it was bound (model.to(),
    load_state_dict(assign=True) with swapped tensors, p.data = ...) is rebound,
    and its dtype may change between float32, bfloat16 and float16 (states stay
    float32); one moved to another device rebuilds the C++ optimizers there, the
    state copied over.

    The checkpoint protocol (what rfsdp.checkpoint uses): settings(),
    sharded_state(p) and load_sharded_state(p, state)."""

    rounding = "nearest"  # how steps write bfloat16 / float16 parameters back

    def _set_groups(self, process_group, timeout_seconds):
        """self.comm, the ranks the C++ optimizers agree over (_default_comm), and
        self._group, those a state dict is placed over (state_layout.default_group)."""
        self.comm = _default_comm(process_group, timeout_seconds, self.param_groups)
        self._group = default_group(process_group)

    def _parts(self, params):
        """[(C++ optimizer, [indices into params], options(group))] for these
        parameters."""
        raise NotImplementedError

    def _all_params(self):
        return [p for g in self.param_groups for p in g["params"]]

    def _bind(self, force=False):
        params = self._all_params()
        old = getattr(self, "_bound_params", None)
        if not force and old is not None and len(old) == len(params) and \
                all(a is b for a, b in zip(old, params)):
            return
        _check_params(type(self).__name__, self.param_groups)
        stepped = getattr(self, "_stepped", set())
        kept = {id(p): self._state_of(p) for p in (old or []) if id(p) in stepped}
        group_index = {id(p): k for k, g in enumerate(self.param_groups) for p in g["params"]}
        self._bound_params = params
        self._bound_keys = _tensor_keys(params)
        self._where = {}
        self._part_list = []
        for n, (impl, idx, options) in enumerate(self._parts(params)):
            groups = [group_index[id(params[i])] for i in idx]
            impl.set_groups(groups)
            impl.set_rounding(self.rounding, n)  # n: each part's own noise
            part = _Part(impl, idx, options, groups)
            for k, i in enumerate(idx):
                self._where[id(params[i])] = (part, k)
            self._part_list.append(part)
        self._send_options()
        self._stepped = set()
        self._published = {}  # id(p) -> the dict self.state[p] holds (its tensors are live)
        for p in params:
            if id(p) in kept:
                self._load_state_of(p, kept[id(p)])
        self._publish()

    def _follow_params(self):
        """Binds the parameters as they are now (before a step): the list (a group
        added, param_groups switched), and each parameter's tensor."""
        self._bind()
        keys = _tensor_keys(self._bound_params)
        if keys == self._bound_keys:
            return
        params = self._bound_params
        changed = [i for i, (a, b) in enumerate(zip(keys, self._bound_keys)) if a != b]
        if any(keys[i][2] != self._bound_keys[i][2] for i in changed):  # another device
            self._bind(force=True)
            return
        for i in changed:
            part, k = self._where[id(params[i])]
            part.impl.set_param(k, local(params[i].data))
        self._bound_keys = keys

    def _send_options(self):
        """Every group's options to the C++ optimizers holding its parameters, where
        they changed since they were last sent (C++ checks them: a bad value is a
        ValueError naming it, and the group keeps its previous options)."""
        for part in self._part_list:
            for k in part.groups:
                opts = part.options(self.param_groups[k])
                if part.sent.get(k) != opts:
                    part.impl.set_group_options(k, *opts)
                    part.sent[k] = opts

    def state_bytes(self):
        """Bytes of this rank's optimizer state: every tensor its C++ optimizers
        keep (codes and scales where quantised)."""
        self._bind()
        return sum(part.impl.state_bytes() for part in self._part_list)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        if getattr(self, "_bound_params", None) is not None:  # a group added later
            self._bind()

    def _state_of(self, p):
        part, k = self._where[id(p)]
        st = dict(part.impl.state(k))
        if part.has_step[k]:
            st["step"] = torch.tensor(float(part.impl.step_count(k)))
        return st

    def _load_state_of(self, p, st):
        part, k = self._where[id(p)]
        for name, t in part.impl.state(k).items():
            if name not in st:
                raise ValueError("%s.load_state_dict: the state of a parameter of shape %s lacks "
                                 "'%s' (saved by another optimizer or with other settings?)"
                                 % (type(self).__name__, tuple(p.shape), name))
            src = st[name]
            if tuple(src.shape) != tuple(t.shape):
                raise ValueError("%s.load_state_dict: '%s' of a parameter has shape %s, this "
                                 "optimizer keeps %s (another world size or block setting?)"
                                 % (type(self).__name__, name, tuple(src.shape), tuple(t.shape)))
            # torch's load_state_dict casts every state tensor to the parameter's dtype
            # (8-bit codes arrive as float32 holding 0..255): the copy casts them back exactly.
            t.copy_(src)
        if part.has_step[k]:
            part.impl.set_step_count(k, int(st["step"]))
        self._stepped.add(id(p))
        self._published.pop(id(p), None)

    def _publish(self):
        """self.state[p] for every parameter that stepped: made once (its tensors are
        the C++ optimizer's own), then only its "step" follows the C++ count (one
        call per C++ optimizer for all of them)."""
        params = self._bound_params
        for part in self._part_list:
            counts = part.impl.step_counts() if any(part.has_step) else None
            for k, i in enumerate(part.idx):
                p = params[i]
                if id(p) not in self._stepped:
                    continue
                st = self._published.get(id(p))
                if st is None or self.state.get(p) is not st:  # new, or replaced by a load
                    self._publish_one(p)
                elif part.has_step[k]:
                    st["step"].fill_(float(counts[k]))

    def _publish_one(self, p):
        st = self._state_of(p)
        self._published[id(p)] = st
        self.state[p] = st

    def _bind_for(self, p):
        """_bind() for a call about parameter p alone: nothing to do where p is bound
        now (its state is current whatever else changed), so the checkpoint
        protocol's per-parameter calls stay O(1) each."""
        where = getattr(self, "_where", None)
        hit = where.get(id(p)) if where is not None else None
        if hit is None or self._bound_params[hit[0].idx[hit[1]]] is not p:
            self._bind()

    def _grads_of(self, idx, zeros_for=()):
        """The gradients of params[idx] (None: no step), zeros set where a parameter
        in zeros_for (indices into params) has none: a rank without a gradient
        still takes part in the collectives."""
        params = self._bound_params
        for i in zeros_for:
            if params[i].grad is None:
                params[i].grad = torch.zeros_like(params[i])
        return [None if params[i].grad is None else local(params[i].grad) for i in idx]

    def _step_all(self):
        """One step of every part: options where they changed, each part's
        gradients in one call (C++ checks them), then the step (NaN/Inf, any
        error: every rank raises before anything changes)."""
        self._follow_params()

        def prepare():
            self._send_options()
            for part in self._part_list:
                part.impl.set_grads(self._grads_of(part.idx, self._needs_grads(part)))
        _agreed(self._part_list[0].impl, prepare)
        for part in self._part_list:
            part.impl.step()
        self._stepped.update(id(p) for p in self._bound_params if p.grad is not None)
        self._publish()

    def _needs_grads(self, part):
        """Indices (into the bound parameters) of part's parameters that need a
        gradient every step (zeros are given where one has none): Muon's matrices."""
        return ()

    # ---- the checkpoint protocol ----

    def settings(self):
        """What shapes this optimizer's states beyond its parameters, as JSON values:
        a checkpoint keeps it and refuses to load into an optimizer whose settings differ."""
        return {"type": type(self).__name__}

    def sequence_spans(self, p):
        """{name: (global size, offset, shared)} for p's 1-D states that are pieces of
        a global sequence whose place this optimizer knows: the first `shared`
        elements are also held (and written) by an earlier rank. Others: none."""
        return {}

    def sharded_state(self, p):
        """Parameter p's state on this rank, by name: the live tensors (a load writes
        into them), and "step" (a 0-D count) where the optimizer keeps one."""
        self._bind_for(p)
        return self._state_of(p)

    def load_sharded_state(self, p, state):
        """Sets p's state from `state` (sharded_state's names and shapes; tensors
        are copied): p then counts as stepped."""
        self._bind_for(p)
        self._load_state_of(p, state)
        self._publish_one(p)

    # ---- torch's state_dict: what DCP's get/set_optimizer_state_dict use ----

    def _settings_json(self):
        return json.dumps(self.settings(), sort_keys=True)

    def _state_layout(self):
        """{(parameter index, state name): state_layout.Entry} of every parameter's
        state, its sequences placed (the placement is collective over the
        checkpoint group the first time after a bind, then cached)."""
        params = self._bound_params
        entries = {}
        for i, p in enumerate(params):
            for e in state_entries(str(i), p, self._state_of(p), self.sequence_spans(p)):
                entries[(i, e.key.split(".", 1)[1])] = e
        if getattr(self, "_placed", None) is None or self._placed[0] is not params:
            self._placed = (params, placements(list(entries.values()), self._group))
        place_sequences(entries.values(), self._placed[1])
        return entries

    def state_dict(self):
        """torch's format: {"state": {index: {name: tensor}}, "param_groups": [...]},
        each group also holding the settings that shape the states
        ("rfsdp_settings": a load into other settings is refused). Sharded
        parameters' states are their global tensors as DCP sees them: a DTensor
        like an FSDP2 parameter's (as torch's optimizers give), else the pieces this
        rank holds of a tensor of the global shape (rfsdp's parameters, block
        scales, tiles); so dcp.save of it, or of get_optimizer_state_dict's, writes
        every rank's part. Under get_optimizer_state_dict(full_state_dict=True):
        the full tensors (gathered; collective). Collective the first time after
        the parameters are bound where tiles or codes need placing."""
        self._bind()
        self._publish()
        sd = super().state_dict()
        sd["state"] = {k: dict(v) for k, v in sd["state"].items()}  # (torch's are the live dicts)
        settings = self._settings_json()
        for g in sd["param_groups"]:
            g["rfsdp_settings"] = settings
        if all(info_of("param", p) is None for p in self._bound_params):
            return sd  # plain (replicated) parameters: plain tensors, as torch's
        full = dcp_caller_options("_get_optim_state_dict")
        layout = self._state_layout()
        gathered = full_tensors(list(layout.values()), self._group) if full and full[0] else None
        for i, st in sd["state"].items():
            for name, t in st.items():
                e = layout.get((i, name))
                if e is not None:
                    st[name] = gathered[e.key] if gathered is not None else dcp_value(e, t)
        return sd

    def _local_value(self, i, name, v, layout):
        """This rank's tensor of parameter i's state `name` from a state dict's value:
        a DTensor's or our pieces' local tensor, a tensor of this rank's shape as it
        is, or (a full state dict) this rank's pieces of a tensor of the global shape,
        written into the live state."""
        if is_dtensor(v):
            return v._local_tensor
        if isinstance(v, Pieces):
            if not hasattr(v, "local"):
                raise ValueError("%s.load_state_dict: state '%s' is a %s without its local tensor"
                                 % (type(self).__name__, name, type(v).__name__))
            return v.local
        e = layout.get((i, name))
        if e is None or e.pieces is None or not torch.is_tensor(v) or tuple(v.shape) != e.shape:
            return v
        with torch.no_grad():
            for o, s, t in e.pieces:
                t.copy_(v[tuple(slice(a, a + n) for a, n in zip(o, s))].reshape(t.shape))
        return dict(self._state_of(self._bound_params[i]))[name]

    def load_state_dict(self, state_dict):
        """torch's format (state_dict()'s: a DCP-loaded one, a full one of
        get_optimizer_state_dict(full_state_dict=True) through set_optimizer_state_dict,
        or local tensors of this layout). States saved with other settings are
        refused. Collective where full tensors need this rank's pieces placed."""
        groups = state_dict["param_groups"]
        saved_settings = {g["rfsdp_settings"] for g in groups if "rfsdp_settings" in g}
        if saved_settings and saved_settings != {self._settings_json()}:
            raise ValueError(
                "%s.load_state_dict: the state was saved by an optimizer with the settings %s; "
                "this one has %s: build it with the saved settings (8-bit blocks, tiles and low-bit "
                "storage shape the states), or move between them with "
                "rfsdp.checkpoint.load(..., requantize=True). Nothing was loaded"
                % (type(self).__name__, sorted(saved_settings)[0], self._settings_json()))
        saved = state_dict["state"]
        ids = [i for g in groups for i in g["params"]]
        # torch's load casts floating states to the parameter's dtype (a bfloat16
        # parameter's float32 moments would lose bits) and cannot take DCP's pieces:
        # it loads the groups alone, the C++ states take the values (each copy
        # converts exactly where it must).
        # (DCP's flattening turns tuples, betas, into lists: they come back as tuples)
        super().load_state_dict({"state": {}, "param_groups": [
            {k: tuple(v) if isinstance(v, list) and isinstance(now.get(k), tuple) else v
             for k, v in g.items() if k != "rfsdp_settings"}
            for g, now in zip(groups, self.param_groups)]})
        self._bind()
        params = self._all_params()
        full = any(info_of("param", p) is not None and torch.is_tensor(v) and v.dim() > 0
                   and not is_dtensor(v) and not isinstance(v, Pieces)
                   for pid, p in zip(ids, params) for v in (saved.get(pid) or {}).values())
        layout = self._state_layout() if full else {}
        for i, (pid, p) in enumerate(zip(ids, params)):
            st = saved.get(pid)
            if st:
                self._load_state_of(p, {name: self._local_value(i, name, v, layout)
                                        for name, v in st.items()})
        self._publish()


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

    @torch.no_grad()
    def step(self, closure=None):
        loss = _run_closure(closure)
        self._step_all()
        return loss


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

    def sequence_spans(self, p):
        self._bind_for(p)
        part, k = self._where[id(p)]
        if "absmax1" not in part.impl.state(k):  # fp32 moments: shaped like the parameter
            return {}
        total, first, shared = part.impl.block_span(k)
        return {"absmax1": (total, first, shared), "absmax2": (total, first, shared)}

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
        spans = self.sequence_spans(p)
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
                _, first, _ = spans[scale]
                out[codes] = q.reshape(-1)[begin * row_len:end * row_len].clone()
                out[scale] = a.reshape(-1)[first:first + live[scale].numel()].clone()
            else:
                out[moment] = whole[begin:end].contiguous().reshape(live[moment].shape)
        out["step"] = full["step"]
        return out


class Muon(_OverCpp):
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
    compute dtype (default: bfloat16 for parameters on a GPU, float32 on the CPU).
    On a GPU the matrices of equal shape rooted on a rank (an expert stack, the
    layers' projections) are orthogonalised as one batch (bmm).

    momentum_dtype: the momentum's storage. torch.float32; torch.bfloat16 (updated
    in fp32, stored rounded); or "int8": 8-bit block-wise codes, blocks of
    momentum_block elements of the global (flattened) tensor with one fp32 absmax
    each and the signed code map momentum_map ("dynamic": bitsandbytes' dynamic
    map, "linear": 256 even steps in [-1, 1]), dequantised, updated and encoded in
    one pass on the owning shard; the update is taken from the fp32 momentum
    before it is encoded, and what is gathered to the roots is unchanged. Codes
    and scales do not depend on the world size; "int8" needs shards of whole
    blocks (plan with rfsdp.policy.combine(rfsdp.policy.muon(...),
    rfsdp.policy.blockwise_8bit(momentum_block))) and runs on the CPU.

    Collective: every rank builds it from the same model and steps together;
    process_group defaults to the shard group of fully_shard's parameters (under
    HSDP the roots are chosen inside it and each replica computes the same
    update), else torch.distributed's default group (none: one process).
    """

    AUX_DEFAULTS = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)

    def __init__(self, param_groups, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5,
                 weight_decay=0.0, adjust_lr="original", process_group=None,
                 ns_dtype=None, timeout_seconds=300.0, momentum_dtype=torch.float32,
                 momentum_block=256, momentum_map="dynamic", rounding="nearest"):
        self.rounding = rounding  # (checked in C++ when bound)
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
        for g in self.param_groups:  # the values are checked in C++ (set_group_options)
            if g["use_muon"] and (isinstance(g["ns_steps"], bool)
                                  or not isinstance(g["ns_steps"], int) or g["ns_steps"] < 1):
                raise ValueError("Muon: ns_steps must be a positive integer, got %r"
                                 % (g["ns_steps"],))
        if ns_dtype is None:
            on_gpu = any(p.device.type == "cuda" for g in self.param_groups for p in g["params"])
            ns_dtype = torch.bfloat16 if on_gpu else torch.float32
        if ns_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("Muon: ns_dtype must be torch.float32 or torch.bfloat16")
        self.ns_dtype = str(ns_dtype).replace("torch.", "")
        if momentum_dtype not in (torch.float32, torch.bfloat16, "int8"):
            raise ValueError("Muon: momentum_dtype must be torch.float32, torch.bfloat16 or "
                             "\"int8\" (8-bit block-wise codes), got %r" % (momentum_dtype,))
        if momentum_map not in ("dynamic", "linear"):
            raise ValueError("Muon: momentum_map must be \"dynamic\" or \"linear\", got %r"
                             % (momentum_map,))
        if isinstance(momentum_block, bool) or not isinstance(momentum_block, int) \
                or momentum_block < 1:
            raise ValueError("Muon: momentum_block must be a positive integer, got %r"
                             % (momentum_block,))
        self.momentum = dict(momentum_dtype=str(momentum_dtype).replace("torch.", ""),
                             momentum_block=momentum_block, momentum_map=momentum_map)
        self._set_groups(process_group, timeout_seconds)
        self._bind()

    def settings(self):
        return dict(super().settings(), ns_dtype=self.ns_dtype, **self.momentum)

    def requantized_state(self, p, saved_settings, full):
        """p's state under this optimizer's momentum storage from a checkpoint's
        full (unsharded) state of p, saved by a Muon with saved_settings (another
        momentum_dtype, momentum_block or momentum_map): the whole momentum (codes
        decoded with the saved blocks and map, or the fp32 / bf16 buffer), then
        this rank's part of it encoded as this optimizer keeps it (within one code
        of the saved values). An AdamW-part parameter's moments: this rank's rows.
        For load_sharded_state."""
        self._bind_for(p)
        _, row_len, begin, end = _row_span(p)
        live = self.sharded_state(p)
        if "exp_avg" in live:  # the AdamW part
            return dict(_like_rows(p, full, live, ("exp_avg", "exp_avg_sq")), step=full["step"])
        if "momentum_codes" in full:
            whole = _C.dequantize_blockwise(
                full["momentum_codes"].reshape(-1), full["momentum_absmax"],
                _C.code_map(saved_settings["momentum_map"], True), saved_settings["momentum_block"])
        elif "momentum_buffer" in full:
            whole = full["momentum_buffer"].reshape(-1).float()
        else:
            raise ValueError("no saved momentum of a parameter of shape %s" % (tuple(p.shape),))
        e0, e1 = begin * row_len, end * row_len
        if "momentum_codes" not in live:
            return {"momentum_buffer": whole[e0:e1].reshape(live["momentum_buffer"].shape)
                    .to(live["momentum_buffer"].dtype)}
        block = self.momentum["momentum_block"]
        q, a = _C.quantize_blockwise(whole.contiguous(), _C.code_map(self.momentum["momentum_map"],
                                                                     True), block)
        return {"momentum_codes": q.reshape(-1)[e0:e1].reshape(live["momentum_codes"].shape).clone(),
                "momentum_absmax": a.reshape(-1)[e0 // block:e0 // block
                                                 + live["momentum_absmax"].numel()].clone()}

    def _parts(self, params):
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        use = [bool(group_of[id(p)]["use_muon"]) for p in params]
        # One C++ optimizer over both parts: one step, one agreement all-reduce
        # (NaN/Inf gradients and Newton-Schulz failures), so neither changes alone.
        self.layout = _C.Muon([_shard_spec(i, p) for i, p in enumerate(params)],
                              [group_of[id(p)]["ns_steps"] for p in params], self.ns_dtype,
                              self.comm, True, use_muon=use, **self.momentum)
        self._muon_idx = [i for i, u in enumerate(use) if u]
        return [(self.layout, list(range(len(params))), _muon_options)]

    def _needs_grads(self, part):
        return self._muon_idx

    @torch.no_grad()
    def step(self, closure=None):
        loss = _run_closure(closure)
        self._step_all()
        return loss


def _muon_options(g):
    betas = g.get("betas", Muon.AUX_DEFAULTS["betas"])
    return (g["lr"], g["momentum"], g["weight_decay"], bool(g["nesterov"]), g["adjust_lr"],
            betas[0], betas[1], g.get("eps", Muon.AUX_DEFAULTS["eps"]))


def _shampoo_options(g):
    return (g["lr"], *g["betas"], g["epsilon"], g["grafting_beta2"], g["grafting_epsilon"],
            g["weight_decay"])


class _Tiled(_OverCpp):
    """Shampoo's and SOAP's shared face: their tiles."""

    def shared_tile_rows(self):
        """Rows of tiles that shard boundaries cut (over all ranks): each goes to
        its owner and back every step; 0 means none."""
        self._bind()
        return self._impl.shared_tile_rows()


class Shampoo(_Tiled):
    """Block Shampoo with Adam grafting (DistributedShampoo's algorithm) over
    ragged shards: every matrix is cut into tiles of at most
    max_preconditioner_dim rows and columns (a 3-D [E, H, I] stack: E matrices
    H x I), each tile's factors L, R and inverse fourth roots live on the rank
    that holds the tile (plan with rfsdp.policy.shampoo(max_preconditioner_dim)),
    so the sharded step is the single-device step and nothing is communicated but
    the NaN/Inf flag. Where shard boundaries cut a row of tiles (torch FSDP2's
    chunk rows), the rank holding its first row owns it: the others send it their
    rows (gradient; M^ and D) and get their update rows back, three all-to-alls a
    step for all such rows (ATen copies: the same path on a CPU and a GPU). 1-D
    parameters and groups with use_shampoo=False take the grafted direction alone (AdamW with grafting_beta2 and grafting_epsilon).

    Per step t of a parameter: V <- b2g V + (1 - b2g) g^2; M <- b1 M + (1 - b1) g;
    D = M^ / (sqrt(V^) + grafting_epsilon) (Adam's, bias-corrected); per tile
    L <- b2 L + (1 - b2) G G^T, R <- b2 R + (1 - b2) G^T G; every
    precondition_frequency steps the roots of L / (1 - b2^t) + epsilon I (and R's),
    by eigendecomposition in fp32, retried in fp64; from start_preconditioning_step
    on, P = L^-1/4 M^ R^-1/4 scaled to |D| per tile, else D; X <- X (1 - lr wd) - lr P.
    factor_dtype=torch.bfloat16 stores L, R and the roots in bf16 (computed in fp32).

    Rank-deficient factors (rare tokens' rows, zero rows, low-rank gradients) are
    normal: rounding then puts their smallest eigenvalues below epsilon, or below
    zero (about -1e-8 of the largest in fp32, -2^-9 in bf16). rank_deficient says
    what the root does with them: "shift" (default; DistributedShampoo's
    perturbation) lifts the spectrum so its smallest eigenvalue is epsilon (needs
    epsilon > 0); "pseudo_inverse" treats eigenvalues <= rank_rtol * the largest as
    zero, leaving their directions unpreconditioned (rank_rtol None: n * eps(float32)
    for an n x n factor); "strict" fails on any eigenvalue <= 0 (retried in fp64;
    three failures in a row on one tile are an error). Roots that do not converge
    or are not finite fail in every mode. Any failure, on any rank, stops the step
    on every rank before anything changes.

    basis_dtype="int8" or "int4" keeps each root A^-1/4 = Q diag(s) Q^T as its
    eigenvectors Q in block-wise codes (blocks of basis_block elements of the
    n x n matrix, one fp32 absmax each; map basis_map: "linear_square" as 4-bit
    Shampoo's, "linear", or "dynamic" at 8 bits; 4-bit codes two to a byte) and s
    in fp32; a step that preconditions rebuilds the root from Q dequantised and
    rectified by bjorck_iterations Björck steps. None: packed roots in
    factor_dtype.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), epsilon=1e-12, grafting_beta2=0.999,
                 grafting_epsilon=1e-8, weight_decay=0.0, max_preconditioner_dim=1024,
                 precondition_frequency=20, start_preconditioning_step=20,
                 use_bias_correction=True, factor_dtype=torch.float32, rank_deficient="shift",
                 rank_rtol=None, basis_dtype=None, basis_block=64, basis_map="linear_square",
                 bjorck_iterations=1, process_group=None, timeout_seconds=300.0,
                 rounding="nearest"):
        self.rounding = rounding  # (checked in C++ when bound)
        for name, v in (("max_preconditioner_dim", max_preconditioner_dim),
                        ("precondition_frequency", precondition_frequency),
                        ("start_preconditioning_step", start_preconditioning_step)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError("Shampoo: %s must be a positive integer, got %r" % (name, v))
        if factor_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("Shampoo: factor_dtype must be torch.float32 or torch.bfloat16")
        if rank_rtol is not None and not (0 <= rank_rtol < 1):
            raise ValueError("Shampoo: rank_rtol must be in [0, 1) (None: n * eps(float32) for an "
                             "n x n factor), got %r" % (rank_rtol,))
        if basis_dtype not in (None, "int8", "int4"):
            raise ValueError("Shampoo: basis_dtype must be None (roots in factor_dtype), \"int8\" "
                             "or \"int4\", got %r" % (basis_dtype,))
        _check_quantised_bases("Shampoo", basis_dtype, basis_map, basis_block, bjorck_iterations)
        self.config = dict(max_preconditioner_dim=max_preconditioner_dim,
                           precondition_frequency=precondition_frequency,
                           start_preconditioning_step=start_preconditioning_step,
                           use_bias_correction=bool(use_bias_correction),
                           factor_dtype=str(factor_dtype).replace("torch.", ""),
                           rank_deficient=rank_deficient,
                           rank_rtol=-1.0 if rank_rtol is None else float(rank_rtol),
                           basis_dtype=basis_dtype, basis_block=basis_block, basis_map=basis_map,
                           bjorck_iterations=bjorck_iterations)
        super().__init__(params, dict(lr=lr, betas=betas, epsilon=epsilon,
                                      grafting_beta2=grafting_beta2,
                                      grafting_epsilon=grafting_epsilon, weight_decay=weight_decay,
                                      use_shampoo=True))
        self._set_groups(process_group, timeout_seconds)
        self._bind()

    def settings(self):
        cfg = dict(self.config)
        if cfg["basis_dtype"] is None:  # packed roots: the settings they had before basis_dtype
            for k in ("basis_dtype", "basis_block", "basis_map", "bjorck_iterations"):
                del cfg[k]
        return dict(super().settings(), **cfg)

    def requantized_state(self, p, saved_settings, full):
        """p's state under this optimizer's root storage from a checkpoint's full
        (unsharded) state of p, saved by a Shampoo with saved_settings (another
        basis_dtype, basis_block, basis_map or bjorck_iterations): each root of this
        rank's tiles as the saved optimizer used it (Q dequantised and rectified,
        with its s; or the packed root, whose eigh gives Q and s), then stored as
        this one keeps it; every other state this rank's piece as saved. For
        load_sharded_state."""
        self._bind_for(p)
        live = self.sharded_state(p)
        out = _like_rows(p, full, live, ("exp_avg", "exp_avg_sq"))
        if "step" in full:
            out["step"] = full["step"]
        if "factor_left" not in live:  # grafting alone
            return out
        tiles, a, b = _tiles_here(p, self.config["max_preconditioner_dim"])
        packed = {True: lambda t: t[1] * (t[1] + 1) // 2, False: lambda t: t[2] * (t[2] + 1) // 2}
        out.update(_pieces(full, live, tiles, a, b, {"factor_left": packed[True],
                                                     "factor_right": packed[False],
                                                     "root_failures": lambda t: 1}))
        old = _lowbit_format(saved_settings.get("basis_dtype"), saved_settings.get("basis_block"),
                             saved_settings.get("basis_map"))
        new = _lowbit_format(self.config["basis_dtype"], self.config["basis_block"],
                             self.config["basis_map"])
        fdt = getattr(torch, self.config["factor_dtype"])
        for left, side in ((True, "root_left"), (False, "root_right")):
            if old is None:  # packed roots R = Q diag(s) Q^T: their eigh
                off = _offsets(tiles, packed[left])
                eig = [torch.linalg.eigh(_C.shampoo_unpack(full[side].reshape(-1), off[k],
                                                           _side(tiles[k], left)).double())
                       for k in range(a, b)]
                qs, ss = [q.float() for _, q in eig], [lam.float() for lam, _ in eig]
            else:
                qs = _decode_squares(full, side + "_basis", tiles, left, old,
                                     saved_settings["bjorck_iterations"], a, b)
                so = _offsets(tiles, lambda t: _side(t, left))
                ss = [full[side + "_eigenvalues"].reshape(-1)[so[k]:so[k + 1]].float()
                      for k in range(a, b)]
            if new is None:
                roots = [_C.shampoo_pack((q.double() * s.double()) @ q.double().T) for q, s in zip(qs, ss)]
                out[side] = torch.cat(roots).to(fdt) if roots else torch.zeros(0, dtype=fdt)
            else:
                out.update(_encode_squares(qs, side + "_basis", new, torch.float32))
                out[side + "_eigenvalues"] = torch.cat(ss) if ss else torch.zeros(0)
        return out

    def _parts(self, params):
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        self._impl = _C.Shampoo([_shard_spec(i, p) for i, p in enumerate(params)],
                                [bool(group_of[id(p)]["use_shampoo"]) for p in params],
                                self.config["max_preconditioner_dim"],
                                self.config["precondition_frequency"],
                                self.config["start_preconditioning_step"],
                                self.config["use_bias_correction"], self.config["factor_dtype"],
                                self.comm, self.config["rank_deficient"],
                                self.config["rank_rtol"], self.config["basis_dtype"] or "",
                                self.config["basis_block"], self.config["basis_map"],
                                self.config["bjorck_iterations"])
        return [(self._impl, list(range(len(params))), _shampoo_options)]

    @torch.no_grad()
    def step(self, closure=None):
        loss = _run_closure(closure)
        self._step_all()
        return loss


# ---- checkpoints into other basis storage (Shampoo's roots, SOAP's bases) ----------------
# A saved state of a tiled optimizer is, per parameter, a global sequence of per-tile
# entries in tile order (each rank's tiles: those whose first element it holds).

def _tiles_here(p, max_dim):
    """p's tiles for the whole tensor, [(first element, rows, cols, row stride)] in
    tile order, and the range [a, b) of them this rank keeps."""
    info = info_of("param", p)
    tiles = _C.shampoo_tile_list(list(info.global_shape if info is not None else p.shape), max_dim)
    _, row_len, begin, end = _row_span(p)
    e0, e1 = begin * row_len, end * row_len
    here = [k for k, t in enumerate(tiles) if e0 <= t[0] < e1]
    return (tiles, here[0], here[-1] + 1) if here else (tiles, 0, 0)


def _offsets(tiles, size):
    """Where each tile's entry starts in a sequence of size(tile) elements per tile."""
    out = [0]
    for t in tiles:
        out.append(out[-1] + size(t))
    return out


def _side(t, left):
    return t[1] if left else t[2]


def _row_span(p):
    """(rows, row_len, begin, end): p's row geometry as the optimizers see it
    (row_dims included) and this rank's rows [begin, end) (all of them unsharded)."""
    info = info_of("param", p)
    if info is None:
        rows, row_len = _C.row_geometry(list(p.shape), 1)
        return rows, row_len, 0, rows
    return info.full_rows, info.row_len, info.row_begin, info.row_end


def _like_rows(p, full, live, names):
    """This rank's rows of p's saved states shaped like the parameter."""
    rows, row_len, begin, end = _row_span(p)
    return {k: full[k].reshape(rows, row_len)[begin:end].reshape(live[k].shape).clone()
            for k in names if k in live}


def _pieces(full, live, tiles, a, b, sizes):
    """This rank's piece of each saved per-tile sequence named in sizes ({name: size(tile)})."""
    out = {}
    for name, size in sizes.items():
        if name in live:
            off = _offsets(tiles, size)
            out[name] = full[name].reshape(-1)[off[a]:off[b]].clone()
    return out


def _tile_view(flat, t, first=None):
    """Tile t of a flat tensor laid out as the whole tensor (first: t's first
    element there; default t's own)."""
    return flat.as_strided((t[1], t[2]), (t[3], 1),
                           flat.storage_offset() + (t[0] if first is None else first))


def _recoded_moments(p, full, live, tiles, a, b):
    """SOAP's m and v of p moved between fp32 and 8-bit codes (one block per tile
    row; dynamic maps, signed for m, unsigned for v): saved codes decoded whole
    and this rank's rows taken, or this rank's tiles of the saved fp32 moments
    encoded."""
    rows, row_len, begin, _ = _row_span(p)
    numel, e0 = rows * row_len, begin * row_len
    out = {}
    for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        code = _C.dynamic_map(signed)
        if name + "_codes" in full:
            whole = torch.empty(numel)
            ao = _offsets(tiles, lambda t: t[1])
            codes, absmax = full[name + "_codes"].reshape(-1), full[name + "_absmax"].reshape(-1)
            for k, t in enumerate(tiles):
                _tile_view(whole, t).copy_(code[_tile_view(codes, t).long()]
                                           * absmax[ao[k]:ao[k + 1]].unsqueeze(1))
            out.update(_like_rows(p, {name: whole}, live, (name,)))
            continue
        whole = full[name].reshape(-1).float()
        codes = torch.zeros(live[name + "_codes"].numel(), dtype=torch.uint8)
        scales = []
        for t in tiles[a:b]:
            q, am = _C.quantize_blockwise(_tile_view(whole, t).contiguous(), code, t[2],
                                          keep_nonzero=not signed)
            _tile_view(codes, t, t[0] - e0).copy_(q.reshape(t[1], t[2]))
            scales.append(am.reshape(-1))
        out[name + "_codes"] = codes.reshape(live[name + "_codes"].shape)
        out[name + "_absmax"] = torch.cat(scales) if scales else torch.zeros(0)
    return out


def _lowbit_format(dtype, block, cmap):
    """(bits, block, map) of basis_dtype "int8" / "int4", else None."""
    return ({"int8": 8, "int4": 4}[dtype], block, cmap) if dtype in ("int8", "int4") else None


def _decode_squares(full, name, tiles, left, fmt, iterations, a, b):
    """Tiles a..b-1's n x n matrices on one side of a saved sequence: fp32 / bf16
    entries, or (fmt) low-bit codes dequantised and Björck-rectified as the saved
    optimizer used them."""
    sizes = [_side(t, left) for t in tiles]
    if fmt is None:
        off = _offsets(tiles, lambda t: _side(t, left) ** 2)
        return [full[name].reshape(-1)[off[k]:off[k + 1]].float().view(sizes[k], sizes[k])
                for k in range(a, b)]
    bits, block, cmap = fmt
    co = _offsets(tiles, lambda t: (_side(t, left) ** 2 * bits + 7) // 8)
    ao = _offsets(tiles, lambda t: -(-_side(t, left) ** 2 // block))
    codes, absmax = full[name + "_codes"].reshape(-1), full[name + "_absmax"].reshape(-1)
    return [_C.bjorck(_C.lowbit_dequantize(codes[co[k]:co[k + 1]], absmax[ao[k]:ao[k + 1]], cmap,
                                           bits, block, sizes[k] ** 2).view(sizes[k], sizes[k]),
                      iterations) for k in range(a, b)]


def _encode_squares(qs, name, fmt, dtype):
    """This rank's entries of a sequence of n x n matrices qs: dtype entries, or
    (fmt) low-bit codes and scales."""
    if fmt is None:
        return {name: torch.cat([q.reshape(-1) for q in qs]).to(dtype) if qs
                else torch.zeros(0, dtype=dtype)}
    bits, block, cmap = fmt
    pairs = [_C.lowbit_quantize(q.contiguous(), cmap, bits, block) for q in qs]
    return {name + "_codes": torch.cat([c for c, _ in pairs]) if pairs else torch.zeros(0, dtype=torch.uint8),
            name + "_absmax": torch.cat([a for _, a in pairs]) if pairs else torch.zeros(0)}


def _check_quantised_bases(who, basis_dtype, basis_map, basis_block, bjorck_iterations):
    """The low-bit basis settings SOAP and Shampoo share (basis_dtype "int8" or "int4")."""
    if basis_map not in ("linear_square", "linear", "dynamic") or \
            (basis_map == "dynamic" and basis_dtype != "int8"):
        raise ValueError("%s: basis_map must be \"linear_square\", \"linear\" or "
                         "\"dynamic\" (int8 only), got %r" % (who, basis_map))
    for name, v, least in (("basis_block", basis_block, 1),
                           ("bjorck_iterations", bjorck_iterations, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ValueError("%s: %s must be an integer >= %d, got %r" % (who, name, least, v))


def _soap_options(g):
    return (g["lr"], *g["betas"], g["shampoo_beta"], g["eps"], g["weight_decay"])


class SOAP(_Tiled):
    """SOAP (Vyas et al. 2024): Adam in the eigenbasis of Shampoo's factors, over
    ragged shards. Tiles are Shampoo's (at most max_preconditioner_dim rows and
    columns; a 3-D [E, H, I] stack: E matrices H x I), each whole on the rank
    that holds it (plan with rfsdp.policy.shampoo(max_preconditioner_dim)), so the
    sharded step is the single-device step. 1-D parameters and groups with
    use_soap=False take Adam with the same betas, eps, bias correction, weight
    decay and first-step skip.

    Per step t of a parameter (s = t - 1 updates so far): at t = 1 only the
    factors L, R and their eigenbases Q_L, Q_R (eigh, descending); from t = 2:
    G' = Q_L^T G Q_R, m <- b1 m + (1 - b1) G, v <- b2 v + (1 - b2) G'^2,
    N = Q_L ((Q_L^T m Q_R) / (sqrt(v) + eps)) Q_R^T,
    p <- (p - lr sqrt(1 - b2^s) / (1 - b1^s) N) (1 - lr weight_decay) (lr alone
    without correct_bias); then L, R <- shampoo_beta (default: betas[1]) decay
    plus G G^T, G^T G; every precondition_frequency updates the bases are
    refreshed by one power step and QR (columns reordered by their estimated
    eigenvalues, v permuted with them), batched by tile size. m and v are fp32;
    factor_dtype and basis_dtype (torch.float32 or torch.bfloat16) store L, R and
    Q_L, Q_R (every step computes in fp32; bf16 bases are orthogonal to about
    1e-2, not rectified). States live with the parameters, on the CPU or a GPU.
    A row of tiles that shard boundaries cut (torch FSDP2's chunk rows) goes to
    the rank holding its first row and back, as Shampoo's (shared_tile_rows()
    counts them). state_dtype="int8" keeps m and v of preconditioned parameters as 8-bit codes
    (dynamic maps, signed for m and unsigned for v), one block per tile row, so
    v's refresh permutation moves whole blocks with their scales; each step
    decodes, updates in fp32 and encodes (CPU only, whole tiles only; 1-D
    parameters and use_soap=False groups keep fp32 moments). basis_dtype="int8" or "int4" stores
    Q_L, Q_R as block-wise codes (blocks of basis_block elements of a tile's
    basis, one fp32 absmax each, the map basis_map: "linear_square" as 4-bit
    Shampoo's, "linear", or "dynamic" at 8 bits; 4-bit codes two to a byte),
    dequantised and rectified by bjorck_iterations Björck steps wherever used.
    """

    def __init__(self, params, lr=3e-3, betas=(0.95, 0.95), shampoo_beta=-1.0, eps=1e-8,
                 weight_decay=0.01, precondition_frequency=10, max_preconditioner_dim=1024,
                 correct_bias=True, factor_dtype=torch.float32, basis_dtype=torch.float32,
                 state_dtype=torch.float32, basis_block=64, basis_map="linear_square",
                 bjorck_iterations=1, process_group=None, timeout_seconds=300.0,
                 rounding="nearest"):
        self.rounding = rounding  # (checked in C++ when bound)
        for name, v in (("max_preconditioner_dim", max_preconditioner_dim),
                        ("precondition_frequency", precondition_frequency)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError("SOAP: %s must be a positive integer, got %r" % (name, v))
        if factor_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("SOAP: factor_dtype must be torch.float32 or torch.bfloat16, got %r"
                             % (factor_dtype,))
        if basis_dtype not in (torch.float32, torch.bfloat16, "int8", "int4"):
            raise ValueError("SOAP: basis_dtype must be torch.float32, torch.bfloat16, \"int8\" "
                             "or \"int4\", got %r" % (basis_dtype,))
        _check_quantised_bases("SOAP", basis_dtype, basis_map, basis_block, bjorck_iterations)
        if state_dtype not in (torch.float32, "int8"):
            raise ValueError("SOAP: state_dtype must be torch.float32 or \"int8\", got %r"
                             % (state_dtype,))
        self.config = dict(max_preconditioner_dim=max_preconditioner_dim,
                           precondition_frequency=precondition_frequency,
                           correct_bias=bool(correct_bias),
                           factor_dtype=str(factor_dtype).replace("torch.", ""),
                           basis_dtype=str(basis_dtype).replace("torch.", ""),
                           state_dtype=str(state_dtype).replace("torch.", ""),
                           basis_block=basis_block, basis_map=basis_map,
                           bjorck_iterations=bjorck_iterations)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), shampoo_beta=shampoo_beta,
                                      eps=eps, weight_decay=weight_decay, use_soap=True))
        self._set_groups(process_group, timeout_seconds)
        self._bind()

    def requantized_state(self, p, saved_settings, full):
        """p's state under this optimizer's storage from a checkpoint's full
        (unsharded) state of p, saved by a SOAP with saved_settings (another
        basis_dtype, basis_block, basis_map, bjorck_iterations or state_dtype):
        each basis of this rank's tiles as the saved optimizer used it
        (dequantised and rectified where quantised), and m and v decoded, then
        stored as this one keeps them; every other state this rank's piece as
        saved. For load_sharded_state."""
        self._bind_for(p)
        live = self.sharded_state(p)
        out = {"step": full["step"]} if "step" in full else {}
        if "factor_left" not in live:  # Adam alone (fp32 moments)
            out.update(_like_rows(p, full, live, ("exp_avg", "exp_avg_sq")))
            return out
        tiles, a, b = _tiles_here(p, self.config["max_preconditioner_dim"])
        out.update(_pieces(full, live, tiles, a, b, {
            "factor_left": lambda t: t[1] * (t[1] + 1) // 2,
            "factor_right": lambda t: t[2] * (t[2] + 1) // 2}))
        if ("exp_avg_codes" in full) == ("exp_avg_codes" in live):  # m and v kept alike
            out.update(_like_rows(p, full, live, ("exp_avg", "exp_avg_sq", "exp_avg_codes",
                                                  "exp_avg_sq_codes")))
            out.update(_pieces(full, live, tiles, a, b, {"exp_avg_absmax": lambda t: t[1],
                                                         "exp_avg_sq_absmax": lambda t: t[1]}))
        else:
            out.update(_recoded_moments(p, full, live, tiles, a, b))
        old = _lowbit_format(saved_settings["basis_dtype"], saved_settings["basis_block"],
                             saved_settings["basis_map"])
        new = _lowbit_format(self.config["basis_dtype"], self.config["basis_block"],
                             self.config["basis_map"])
        dtype = None if new else getattr(torch, self.config["basis_dtype"])
        for left, side in ((True, "basis_left"), (False, "basis_right")):
            qs = _decode_squares(full, side, tiles, left, old, saved_settings["bjorck_iterations"], a, b)
            out.update(_encode_squares(qs, side, new, dtype))
        return out

    def settings(self):
        return dict(super().settings(), **self.config)

    def _parts(self, params):
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        self._impl = _C.SOAP([_shard_spec(i, p) for i, p in enumerate(params)],
                             [bool(group_of[id(p)]["use_soap"]) for p in params],
                             self.config["max_preconditioner_dim"],
                             self.config["precondition_frequency"],
                             self.config["correct_bias"], self.config["factor_dtype"],
                             self.config["basis_dtype"], self.comm, self.config["state_dtype"],
                             self.config["basis_block"], self.config["basis_map"],
                             self.config["bjorck_iterations"])
        return [(self._impl, list(range(len(params))), _soap_options)]

    @torch.no_grad()
    def step(self, closure=None):
        loss = _run_closure(closure)
        self._step_all()
        return loss
