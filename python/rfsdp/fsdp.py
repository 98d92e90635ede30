"""rfsdp.fully_shard: FSDP2-style per-module sharding over RaggedFSDP units.

Each fully_shard(module) call makes one unit of the parameters of `module` not
claimed by an inner call. The module's parameters become this rank's shards
(rows [row_begin, row_end) of each tensor, views of the unit's local fp32 slice;
rfsdp.shard_info(p) describes them). Forward gathers the full parameters (and
reshards after, if asked); backward gathers again before the module's backward,
then reduce-scatters each unit's gradients into the local gradient slice as soon
as its last gradient lands (it runs while backward moves on; it is finished, and
its gathered gradient buffer freed, before the next unit allocates its own, so
at most one unit's gradient buffer is live: measured, the same step time and 4
fewer percentage points of peak memory this way). The local slice
is each shard's .grad (summed across micro-batches until the optimizer zeroes it).

Prefetch: the units under one outer fully_shard call share a schedule that
records their forward order; from the second forward on, a unit starting its
forward starts the all-gather of the unit after it, and a unit starting its
backward starts the all-gather of the unit before it, so the gather overlaps
compute. Every rank must run the units in the same order (as with any FSDP).
set_prefetch(model, False) turns it off (to measure the overlap).

On a GPU (parameters on a CUDA device): gathers run on a side stream, reduce-
scatters on another, compute on the current stream, ordered by CUDA events
(fsdp/device_streams.h); waiting on a collective orders the current stream
after it and does not block the host. The default mixed precision there is
bfloat16 parameters with float32 gradient reduction."""
import enum
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from . import _C
from . import policy as policy_mod
from .planning import PlannerOptions
from ._comm import make_comm


class ShardInfo:
    """Where a sharded parameter's rows come from, and the groups it lives in: a
    view of its shard descriptor (`shard`, a _C.TensorShard: the full shape, its
    row geometry, this rank's rows and, from fully_shard's plan, every rank's),
    which the optimizers, clipping and the checkpoint read as it is.
    process_group shards it (the ranks whose rows together make the tensor);
    replicate_group (HSDP; None for plain FSDP) holds the ranks with equal rows."""

    __slots__ = ("shard", "process_group", "replicate_group")

    def __init__(self, name, global_shape, row_dims, row_begin, row_end, process_group=None,
                 replicate_group=None, rank_rows=()):
        self.shard = _C.TensorShard(name, list(global_shape), row_dims, row_begin, row_end,
                                    list(rank_rows))
        self.process_group = process_group
        self.replicate_group = replicate_group

    @classmethod
    def of(cls, shard, process_group=None, replicate_group=None):
        info = cls.__new__(cls)
        info.shard, info.process_group, info.replicate_group = shard, process_group, replicate_group
        return info

    name = property(lambda self: self.shard.name)
    global_shape = property(lambda self: self.shard.shape)
    row_dims = property(lambda self: self.shard.row_dims)
    row_begin = property(lambda self: self.shard.row_begin)
    row_end = property(lambda self: self.shard.row_end)
    row_len = property(lambda self: self.shard.row_len)
    full_rows = property(lambda self: self.shard.full_rows)
    rank_rows = property(lambda self: self.shard.rank_rows)  # [] where unknown

    def _key(self):
        return (self.name, self.global_shape, self.row_dims, self.row_begin, self.row_end)

    def __eq__(self, other):
        return isinstance(other, ShardInfo) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        return "ShardInfo(name=%r, global_shape=%r, row_dims=%d, row_begin=%d, row_end=%d)" % \
            self._key()

    def __reduce__(self):  # groups live in one process: a pickled ShardInfo drops them
        return (ShardInfo.of, (self.shard,))


@dataclass
class MixedPrecisionPolicy:
    """param_dtype: dtype of the gathered parameters forward and backward run in
    (float32, bfloat16, float16); reduce_dtype: dtype gradients are reduce-scattered
    in; cast_forward_inputs: cast a unit's floating-point tensor inputs to
    param_dtype (as FSDP2 does), so a float32 batch meets bfloat16 weights."""
    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    cast_forward_inputs: bool = True

    DTYPES = (torch.float32, torch.bfloat16, torch.float16)

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in self.DTYPES:
                raise ValueError("MixedPrecisionPolicy: %s must be torch.float32, torch.bfloat16 "
                                 "or torch.float16, got %r" % (name, getattr(self, name)))


class TrainingState(enum.Enum):
    """Where a unit is in a step (FSDP2's TrainingState is the model)."""
    IDLE = "idle"              # between steps, or done with this pass
    FORWARD = "forward"        # between its pre-forward and post-forward
    BACKWARD = "backward"      # from its first gradient to the end of backward


class DataState(enum.Enum):
    """What a unit's buffers hold now."""
    SHARDED = "sharded"        # the local slices only
    GATHERING = "gathering"    # a prefetch all-gather is in flight
    GATHERED = "gathered"      # the full parameters are live
    REDUCING = "reducing"      # a gradient reduce-scatter is in flight


def shard_info(param):
    """The ShardInfo of a parameter managed by fully_shard, else None."""
    return getattr(param, "_rfsdp_shard", None)


class _Unit:
    def __init__(self, entries, comm, replicate_comm, pg, rg, pol, mp, reshard_after_forward,
                 planner, device):
        # entries[i]: every place parameter i stands, [(owner module, attr name, fqn)];
        # a tied parameter stands in several and is sharded once, under the first name.
        self.entries = entries
        self.reshard_after_forward = reshard_after_forward
        params = [uses[0][0]._parameters[uses[0][1]] for uses in entries]
        dtype_bytes = torch.empty((), dtype=mp.param_dtype).element_size()
        specs = []
        for uses, p in zip(entries, params):
            fqn = uses[0][2]
            g = pol.granule(fqn, p)
            specs.append((fqn, list(p.shape), 0 if g == policy_mod.WHOLE else g,
                          pol.row_dims(fqn, p) if p.dim() > 0 else 1, dtype_bytes))
        self.plan = _C.plan_specs(specs, pg.size(), 16, planner.max_buffers,
                                  planner.collective_cost_bytes)
        self.comm = comm  # kept: rfsdp closes it at exit (see _comm)
        self.replicate_comm = replicate_comm
        # agree=False: fully_shard agreed on all of this (and more) already.
        self.unit = _C.FSDPUnit(self.comm, self.plan, str(mp.param_dtype).replace("torch.", ""),
                                str(mp.reduce_dtype).replace("torch.", ""), self.replicate_comm,
                                str(device), False)
        # Every rank starts from the values of the shard group's rank 0: one all-reduce
        # of its values and zeros elsewhere (exact; one collective for the whole unit);
        # under HSDP, replica 0's then go to the other replicas (one broadcast).
        flat = torch.cat([p.detach().to(torch.float32).reshape(-1) for p in params])
        if pg.size() > 1:
            if pg.rank() != 0:
                flat.zero_()
            dist.all_reduce(flat, group=pg)
        if self.replicate_comm is not None:
            dist.broadcast(flat, src=dist.get_global_rank(rg, 0), group=rg)
        full = [t.view(p.shape) for t, p in zip(flat.split([p.numel() for p in params]), params)]
        self.unit.shard(full)
        self.sharded, self.full = [], []
        for i, (uses, p) in enumerate(zip(entries, params)):
            sp = nn.Parameter(self.unit.local_param(i), requires_grad=p.requires_grad)
            sp._rfsdp_shard = ShardInfo.of(self.unit.tensor_shard(i), pg,
                                           rg if self.replicate_comm is not None else None)
            p._rfsdp_replaced = uses[0][2]  # an optimizer built on the old parameter is an error
            self.sharded.append(sp)
            fp = nn.Parameter(self.unit.full_param(i).data, requires_grad=p.requires_grad)
            self.full.append(fp)
        self._use(self.sharded)
        self.state = TrainingState.IDLE
        self.cast_to = mp.param_dtype if mp.cast_forward_inputs and mp.param_dtype != torch.float32 else None
        # Each unit's reduce-scatter starts as soon as its last gradient lands: a hook
        # on every full parameter's AccumulateGrad node (kept alive here; found at the
        # first backward, when the storage is live) counts them. The reduce runs
        # while backward moves on (it is finished before the next unit allocates its
        # gradient buffer), and the unit's gathered parameters go at once. Units
        # missing a gradient reduce at the end of backward.
        self.grad_nodes = None
        self.grads_waiting = 0
        self.reduce_handle = None
        self.pending = None     # handle of a prefetch all-gather not yet waited on
        self.schedule = None    # the _Schedule of the outermost fully_shard call above
        self.recomputing = False  # this forward runs inside backward (checkpointing)

    def data_state(self):
        if self.reduce_handle is not None and not self.reduce_handle.waited():
            return DataState.REDUCING
        if self.pending is not None:
            return DataState.GATHERING
        return DataState.GATHERED if self.unit.unsharded() else DataState.SHARDED

    # -- forward --------------------------------------------------------------
    def _use(self, tensors):
        for uses, t in zip(self.entries, tensors):
            for owner, attr, _ in uses:
                owner._parameters[attr] = t

    def unshard(self):
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        elif not self.unit.unsharded():
            self.unit.unshard().wait()

    def prefetch(self):
        if self.pending is None and not self.unit.unsharded():
            self.pending = self.unit.unshard()

    def settle(self):
        """A prefetch this pass did not use: finish it and free the buffer."""
        if self.pending is not None and self.state is TrainingState.IDLE:
            self.pending.wait()
            self.pending = None
            self.unit.reshard()

    def pre_forward(self, module, args):
        # Inside backward, a forward is activation checkpointing's recomputation
        # (reentrant or not): gather again if needed, but record no order, prefetch
        # nothing, and keep the parameters gathered for the backward that follows.
        self.recomputing = torch._C._current_graph_task_id() != -1
        if not self.recomputing:
            self.state = TrainingState.FORWARD
            if self.schedule is not None:
                self.schedule.forward_started(self)
        self.unshard()
        self._use(self.full)
        if self.cast_to is not None:
            return _cast_floating(args, self.cast_to)
        return None

    def post_forward(self, module, args, output):
        self._use(self.sharded)
        if not self.recomputing:
            self.state = TrainingState.IDLE
            if self.reshard_after_forward:
                self.unit.reshard()
        if torch.is_grad_enabled() and self.state is not TrainingState.BACKWARD:
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(self._pre_backward_hook)
        return output

    # -- backward -------------------------------------------------------------
    def _pre_backward_hook(self, grad):
        if self.state is not TrainingState.BACKWARD:
            self.state = TrainingState.BACKWARD
            if self.schedule is not None:
                self.schedule.backward_started(self)
            self.unshard()
            if self.schedule is not None and self.schedule.reducing is not None:
                self.schedule.reducing._finish_reduce()  # its gradient buffer goes first
            self.unit.prepare_grads()
            for i, fp in enumerate(self.full):
                g = self.unit.full_grad(i)
                # Backward adds into the gradient view in place; with another reduce
                # dtype it lands in a fresh .grad that _post_backward copies over.
                fp.grad = g.data if fp.dtype == g.dtype else None
            if self.grad_nodes is None:
                self.grad_nodes = []
                with torch.enable_grad():
                    for fp in self.full:
                        if fp.requires_grad:
                            node = fp.expand_as(fp).grad_fn.next_functions[0][0]
                            node.register_hook(self._grad_landed)
                            self.grad_nodes.append(node)
            self.grads_waiting = len(self.grad_nodes)
            torch.autograd.Variable._execution_engine.queue_callback(self._post_backward)
        return None

    def _grad_landed(self, grad_inputs, grad_outputs):
        if self.state is TrainingState.BACKWARD and self.reduce_handle is None:
            self.grads_waiting -= 1
            if self.grads_waiting == 0:
                self._start_reduce()

    def _start_reduce(self):
        for i, fp in enumerate(self.full):
            g_full = self.unit.full_grad(i)
            if fp.grad is not None and fp.grad.data_ptr() != g_full.data_ptr():
                g_full.copy_(fp.grad)  # mixed precision: gradient dtype != reduce dtype
            fp.grad = None
        # The optimizer's zero_grad set .grad to None: tell the unit (it owns "zeroed"),
        # so the reduce-scatter writes straight into the local gradient slice instead
        # of adding a scratch copy. Shards zeroed one by one are zeroed in place.
        trained = [sp for sp in self.sharded if sp.requires_grad]
        if trained and all(sp.grad is None for sp in trained):
            self.unit.zero_grad()
        else:
            for i, sp in enumerate(self.sharded):
                if sp.requires_grad and sp.grad is None:
                    self.unit.local_grad(i).zero_()
        self.reduce_handle = self.unit.reduce_grads(True)
        self.unit.reshard()
        if self.schedule is not None:  # one reduce in flight: finish the one before
            if self.schedule.reducing is not None:
                self.schedule.reducing._finish_reduce()
            self.schedule.reducing = self

    def _finish_reduce(self):
        if self.reduce_handle is not None and not self.reduce_handle.waited():
            self.reduce_handle.wait()  # frees the gathered gradient buffer
            for i, sp in enumerate(self.sharded):
                if sp.requires_grad:
                    sp.grad = self.unit.local_grad(i)
        if self.schedule is not None and self.schedule.reducing is self:
            self.schedule.reducing = None

    def _post_backward(self):
        """End of backward: finish this unit's reduce-scatter; .grad = the local slice."""
        # A checkpoint's recomputation may stop inside this unit's forward (non-reentrant
        # checkpoints stop once they have what backward needs): put the shards back.
        self._use(self.sharded)
        if self.reduce_handle is None:
            self._start_reduce()
        self._finish_reduce()
        self.reduce_handle = None
        self.state = TrainingState.IDLE


class _Schedule:
    """The forward order of the units under one outer fully_shard call, recorded
    on every forward; prefetch uses the previous forward's order."""

    def __init__(self, units_):
        self.units = units_
        self.order, self.recording = [], []
        self.prefetching = True
        self.backward_queued = False
        self.reducing = None  # the unit whose reduce-scatter is in flight
        for u in units_:
            u.schedule = self

    def root_pre_forward(self, module, args):
        self.recording = []

    def root_post_forward(self, module, args, output):
        self.order = self.recording
        for u in self.units:
            u.settle()

    def _neighbour(self, unit, step):
        if not self.prefetching:
            return None
        try:
            i = self.order.index(unit) + step
        except ValueError:
            return None
        return self.order[i] if 0 <= i < len(self.order) else None

    def forward_started(self, unit):
        self.recording.append(unit)
        nxt = self._neighbour(unit, 1)
        if nxt is not None and nxt is not unit:
            nxt.prefetch()

    def backward_started(self, unit):
        if not self.backward_queued:
            self.backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        prev = self._neighbour(unit, -1)
        if prev is not None and prev is not unit and prev.state is not TrainingState.BACKWARD:
            prev.prefetch()

    def _backward_done(self):
        self.backward_queued = False
        for u in self.units:
            u.settle()


def _cast_floating(x, dtype):
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, (list, tuple)):
        return type(x)(_cast_floating(v, dtype) for v in x)
    if isinstance(x, dict):
        return {k: _cast_floating(v, dtype) for k, v in x.items()}
    return x


def _tensors(out):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (list, tuple)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o)


def _collect(module):
    """The parameters of module that no inner fully_shard call claimed, each with
    every place it stands (a parameter tied to several modules is one entry), and
    their devices. Storage shared in ways a shard cannot keep is refused."""
    entries, index, devices, storages = [], {}, set(), []
    for owner_name, owner in module.named_modules():
        for attr, p in owner._parameters.items():
            if p is None or shard_info(p) is not None:  # an inner call's shard
                continue
            fqn = (owner_name + "." if owner_name else "") + attr
            claimed = getattr(p, "_rfsdp_replaced", None)
            if claimed is not None:
                raise ValueError(
                    "fully_shard: '%s' is the parameter '%s', which an inner fully_shard call "
                    "already sharded: a parameter shared by two units is not supported. Shard "
                    "every module that uses it in one call (e.g. a tied embedding and head both in "
                    "the root's call)" % (fqn, claimed))
            if id(p) in index:  # tied: another use of a parameter met already
                entries[index[id(p)]].append((owner, attr, fqn))
                continue
            if p.numel() > 0 and p.device.type != "meta":  # meta tensors have no memory
                lo = p.data_ptr()
                hi = lo + p.numel() * p.element_size()
                for other_lo, other_hi, other in storages:
                    if lo < other_hi and other_lo < hi:
                        raise ValueError(
                            "fully_shard: parameters '%s' and '%s' are different tensors over the "
                            "same memory; sharding would separate them. Tie them as one "
                            "parameter (b.weight = a.weight) or give each its own storage"
                            % (other, fqn))
                storages.append((lo, hi, fqn))
            index[id(p)] = len(entries)
            entries.append([(owner, attr, fqn)])
            devices.add(p.device)
    return entries, devices


def _groups(mesh, process_group, replicate_group):
    """(shard group, replicate group or None) from fully_shard's arguments."""
    if mesh is not None:
        if process_group is not None or replicate_group is not None:
            raise ValueError("fully_shard: give either mesh or process_group/replicate_group, "
                             "not both")
        if mesh.ndim == 1:
            return mesh.get_group(0), None
        if mesh.ndim == 2:  # FSDP2's HSDP convention: dim 0 replicates, dim 1 shards
            return mesh.get_group(1), mesh.get_group(0)
        raise ValueError("fully_shard: mesh must be 1-D (shard) or 2-D (replicate, shard), "
                         "got %d dimensions" % mesh.ndim)
    pg = process_group if process_group is not None else dist.group.WORLD
    if pg is None:
        raise ValueError("fully_shard needs torch.distributed initialised "
                         "(dist.init_process_group), a mesh or an explicit process_group")
    if replicate_group is not None and dist.is_initialized():
        world = dist.get_world_size()
        if pg.size() * replicate_group.size() != world:
            raise ValueError("fully_shard: a shard group of %d ranks and a replicate group of %d "
                             "do not make the world of %d; HSDP needs shard x replicate = world "
                             "(build both from a 2-D DeviceMesh)"
                             % (pg.size(), replicate_group.size(), world))
    return pg, replicate_group


_CALLS = {}  # the ranks of a shard group -> fully_shard calls this process made over it


def _describe(module, call, entries, pol, mp, reshard_after_forward, planner):
    """What every rank of the group must hold alike for this fully_shard call: the
    call's place in this process's sequence, every parameter's name, shape, dtype,
    device type and granule, the settings, and the inner calls (by name, with their
    place in the sequence: blocks sharded in another order differ there)."""
    lines = ["call %d of fully_shard, on a %s" % (call, type(module).__name__)]
    for uses in entries:
        owner, attr, fqn = uses[0]
        p = owner._parameters[attr]
        try:
            layout = "granule %s, row_dims %s" % (
                pol.granule(fqn, p), pol.row_dims(fqn, p) if p.dim() > 0 else 1)
        except Exception as e:  # noqa: BLE001 (an error is part of what must agree)
            layout = "policy error: %s" % e
        lines.append("parameter '%s': shape %s, %s on %s, requires_grad %s, %s, %d uses"
                     % (fqn, list(p.shape), p.dtype, p.device.type, p.requires_grad, layout,
                        len(uses)))
    lines.append("mixed precision %s, reshard_after_forward %s, planner %s"
                 % (mp, reshard_after_forward, planner))
    for name, m in module.named_modules():
        if m is not module and getattr(m, "_rfsdp_call", None) is not None \
                and getattr(m, "_rfsdp_unit", None) is not None:
            lines.append("inner fully_shard of '%s': call %d" % (name, m._rfsdp_call))
    return lines


def _agree(module, comms, lines):
    """One small collective per group: every rank's lines must be equal; if not,
    every rank raises a ValueError naming the first difference and the ranks."""
    for comm in comms:
        if comm is not None and comm.size() > 1:
            _C.agree_lines(comm, lines, "fully_shard(%s)" % type(module).__name__)


def fully_shard(module, *, mesh=None, process_group=None, replicate_group=None, policy=None,
                mp_policy=None, reshard_after_forward=True, planner=None):
    """Shards the parameters of `module` that no inner fully_shard call claimed
    (apply bottom-up, like FSDP2's fully_shard). Returns the module.

    Groups: process_group (default: torch.distributed's default group) shards
    every unit. HSDP: replicate_group holds the ranks with equal shards (one per
    shard group), or mesh, a DeviceMesh as FSDP2 takes it: 1-D shards over its
    ranks, 2-D (replicate, shard) shards along dim 1 and replicates along dim 0.
    Gradients reduce-scatter inside the shard group and all-reduce across the
    replicas (the mean over every rank); optimizers and clipping work inside the
    shard group. planner: rfsdp.PlannerOptions (how many flat buffers, each with
    its own collective, a unit may take; default: up to 4 where they pad less)."""
    if getattr(module, "_rfsdp_unit", None) is not None:
        raise ValueError("fully_shard was already applied to this %s" % type(module).__name__)
    pg, rg = _groups(mesh, process_group, replicate_group)
    pol = policy if policy is not None else policy_mod.adamw()
    entries, devices = _collect(module)
    planner = planner if planner is not None else PlannerOptions()
    if not isinstance(planner, PlannerOptions):
        raise ValueError("fully_shard: planner must be an rfsdp.PlannerOptions, got %r" % (planner,))
    # Before anything else that could differ between ranks (and before any other
    # collective): ranks that shard different modules would meet in collectives of
    # different sizes, which abort the processes inside Gloo.
    key = tuple(dist.get_process_group_ranks(pg)) if dist.is_initialized() else ()
    call = _CALLS.get(key, 0)
    _CALLS[key] = call + 1
    module._rfsdp_call = call
    comm = make_comm(pg)  # kept by the unit: rfsdp closes it at exit (see _comm)
    replicate_comm = make_comm(rg) if rg is not None and rg.size() > 1 else None
    _agree(module, (comm, replicate_comm),
           _describe(module, call, entries, pol, mp_policy, reshard_after_forward, planner))
    if len(devices) > 1:
        raise ValueError("fully_shard: the parameters of this module live on different devices (%s); "
                         "move the module to one device first" % sorted(str(d) for d in devices))
    device = next(iter(devices)) if devices else torch.device("cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError("fully_shard: parameters on %s are not supported; move the module to the "
                         "CPU or a CUDA device" % device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    for uses in entries:
        p = uses[0][0]._parameters[uses[0][1]]
        if p.dtype != torch.float32:
            # Shards are float32 master weights; converting here would change the model silently.
            raise ValueError("fully_shard: parameter '%s' is %s; shards hold float32 master "
                             "weights: convert the module with .float() first (compute in bf16 "
                             "or fp16 with mp_policy=MixedPrecisionPolicy(param_dtype=...))"
                             % (uses[0][2], p.dtype))
    mp = mp_policy
    if mp is None:  # GPUs compute in bfloat16 and reduce in float32 by default
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if device.type == "cuda" \
            else MixedPrecisionPolicy()
    unit = _Unit(entries, comm, replicate_comm, pg, rg, pol, mp, reshard_after_forward, planner,
                 device) if entries else None
    module._rfsdp_unit = unit if unit is not None else False
    # This call's schedule takes over the units of the calls below it (their
    # schedules are emptied). Its pre-hook runs before the unit's, its post-hook after.
    inner = units(module)
    schedule = None
    if len(inner) > 1:
        for u in inner:
            if u.schedule is not None:
                u.schedule.units = []
        schedule = _Schedule(inner)
        module.register_forward_pre_hook(schedule.root_pre_forward)
    if unit is not None:
        module.register_forward_pre_hook(unit.pre_forward)
        module.register_forward_hook(unit.post_forward)
    if schedule is not None:
        module.register_forward_hook(schedule.root_post_forward)
    return module


def units(model):
    return [m._rfsdp_unit for m in model.modules() if getattr(m, "_rfsdp_unit", None)]


def set_prefetch(model, enabled):
    """Turns the all-gather prefetch of model's units on (the default) or off
    (each unit then gathers when it starts: no overlap; for measurements)."""
    us = units(model)
    if not us:
        raise ValueError("set_prefetch: the model has no fully_shard units")
    for u in us:
        if u.schedule is not None:
            u.schedule.prefetching = bool(enabled)


def clip_grad_norm_(model, max_norm, error_if_nonfinite=True):
    """Clips the sharded gradients of all of model's units by their global L2
    norm (one all-reduce); returns the norm."""
    us = units(model)
    if not us:
        raise ValueError("clip_grad_norm_: the model has no fully_shard units")
    return _C.clip_grad_norm([u.unit for u in us], float(max_norm), bool(error_if_nonfinite))


def full_parameters(model, process_group=None):
    """{name: full tensor} of a fully sharded model's parameters, on every rank
    (each rank of a parameter's shard group contributes its rows; one all-reduce
    per parameter). For checks and small-model checkpoints: it holds the whole
    model on every rank."""
    out = {}
    for name, p in model.named_parameters():
        info = shard_info(p)
        if info is None:
            out[name] = p.detach().clone()
            continue
        pg = process_group or info.process_group or dist.group.WORLD
        rows = torch.zeros(info.full_rows, info.row_len, dtype=p.dtype, device=p.device)
        rows[info.row_begin:info.row_end] = p.detach().reshape(-1, info.row_len)
        if pg.size() > 1:
            dist.all_reduce(rows, group=pg)
        out[name] = rows.reshape(info.global_shape)
    return out
