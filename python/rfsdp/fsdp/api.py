"""rfsdp.fully_shard and the module type it gives: FSDP2's API over RaggedFSDP units.

Each fully_shard(module) call makes one unit of the parameters of `module` not
claimed by an inner call, and turns the module into an FSDPModule (its class
becomes a subclass of FSDPModule and of its own class, with the same name, as
FSDP2 does), whose methods (unshard, reshard, set_requires_gradient_sync, ...)
have FSDP2's names and meanings.

On a GPU (parameters on a CUDA device): gathers run on a side stream, reduce-
scatters on another, compute on the current stream, ordered by CUDA events
(fsdp/device_streams.h); waiting on a collective orders the current stream
after it and does not block the host. The default mixed precision there is
bfloat16 parameters with float32 gradient reduction."""
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import _C
from .. import policy as policy_mod
from .._comm import make_comm
from ..dcp.gather import full_rows
from ..planning import PlannerOptions
from . import state_dict as state_dict_mod
from .dtensor import is_dtensor, is_sharded, local, root_mesh, whole_mesh_group
from .schedule import Schedule
from .tp_pieces import MeshDims, TPPiece
from .unit import MixedPrecisionPolicy, TrainingState, Unit, shard_info


class UnshardHandle:
    """What FSDPModule.unshard(async_op=True) returns: wait() finishes the
    all-gather and puts the full parameters into the module."""

    def __init__(self, unit: Optional[Unit]):
        self._unit = unit

    def wait(self) -> None:
        if self._unit is not None:
            self._unit.use_full()
            self._unit = None


class FSDPModule:
    """The methods every module fully_shard returns has (FSDP2's FSDPModule)."""

    def _units_below(self, recurse: bool) -> List[Unit]:
        mods = self.modules() if recurse else [self]
        return [m._rfsdp_unit for m in mods if getattr(m, "_rfsdp_unit", None)]

    def _own_unit(self) -> Optional[Unit]:
        return self._rfsdp_unit or None

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """All-gathers this module's own parameters (not its children's) and puts
        them into the module; forward then uses them without gathering. With
        async_op=True the gather runs in the background: wait() on the handle."""
        unit = self._own_unit()
        if unit is not None:
            _check_idle(unit, "unshard")
            unit.prefetch()
        handle = UnshardHandle(unit)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Frees this module's gathered parameters; the module holds its shards again."""
        unit = self._own_unit()
        if unit is not None:
            _check_idle(unit, "reshard")
            unit.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """False: backward adds gradients into each unit's full gradient buffer and
        reduce-scatters nothing (gradient accumulation without communication, at
        the memory of the full gradients); the next backward with True adds its
        gradients and reduce-scatters the sum once."""
        for u in self._units_below(recurse):
            u.requires_grad_sync = bool(requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        value = _reshard_after_forward(reshard_after_forward)
        for u in self._units_below(recurse):
            u.reshard_after_forward = value

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """False keeps the parameters gathered after a backward with gradient sync
        off (the next micro-batch's forward gathers nothing). A synced backward
        always reshards: the optimizer step that follows changes the shards."""
        for u in self._units_below(recurse):
            u.reshard_after_backward = bool(reshard_after_backward)

    def set_modules_to_forward_prefetch(self, modules: List[nn.Module]) -> None:
        """When this module's forward starts, start the all-gathers of these
        (instead of the next unit in the recorded order)."""
        self._own_unit_or_error("set_modules_to_forward_prefetch").forward_prefetch = \
            _units_of(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: List[nn.Module]) -> None:
        """When this module's backward starts, start the all-gathers of these
        (instead of the unit before it in the recorded order)."""
        self._own_unit_or_error("set_modules_to_backward_prefetch").backward_prefetch = \
            _units_of(modules, "set_modules_to_backward_prefetch")

    def _apply(self, fn, recurse=True):
        """nn.Module's conversions (model.to(), .float(), to_empty(), ...) keep this
        module's shards in its unit's flat buffer, where the collectives read them:
        one that keeps device and dtype (model.to(torch.device("cpu", 0)), as
        accelerate's prepare_model calls it) copies the values back there; one that
        would change them is refused before anything changes."""
        unit = self._own_unit()
        if unit is not None:
            unit.check_conversion(fn, "%s.to() / .cuda() / .half()" % type(self).__name__)
            had = [up.sharded.grad is up.grad for up in unit.params]
        out = super()._apply(fn, recurse)
        if unit is not None:
            unit.keep_shards_home(had)
        return out

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 code; rfsdp finishes every reduce-scatter at the end
        of each backward, so there is nothing to defer to the last one."""
        self._rfsdp_last_backward = bool(is_last_backward)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """FSDP1's name: clips the gradients of this module's parameters by their
        global norm (torch.nn.utils.clip_grad_norm_ over the shards); returns it."""
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type)

    def _own_unit_or_error(self, what: str) -> Unit:
        unit = self._own_unit()
        if unit is None:
            raise ValueError("%s: this %s's fully_shard call sharded no parameters of its own"
                             % (what, type(self).__name__))
        return unit

    # FSDP2 methods rfsdp does not have: loud, saying what to do instead.
    def set_requires_all_reduce(self, *args, **kwargs):
        raise NotImplementedError(
            "rfsdp: set_requires_all_reduce is not supported: under HSDP every synced backward "
            "all-reduces across replicas; use set_requires_gradient_sync(False) to skip both")

    def set_reduce_scatter_divide_factor(self, *args, **kwargs):
        raise NotImplementedError(
            "rfsdp: set_reduce_scatter_divide_factor is not supported: gradients are averaged "
            "over every data-parallel rank; scale the loss instead")

    def set_post_optim_event(self, *args, **kwargs):
        raise NotImplementedError("rfsdp: set_post_optim_event is not supported: the next "
                                  "forward's gather waits on the current stream")

    def set_unshard_in_backward(self, *args, **kwargs):
        raise NotImplementedError("rfsdp: set_unshard_in_backward is not supported: a unit "
                                  "always gathers for its backward")

    def set_custom_all_gather(self, *args, **kwargs):
        raise NotImplementedError("rfsdp: custom all-gathers are not supported: gathers run in "
                                  "place on the unit's flat buffer")

    def set_custom_reduce_scatter(self, *args, **kwargs):
        raise NotImplementedError("rfsdp: custom reduce-scatters are not supported: they run in "
                                  "place on the unit's flat buffer")


def _check_idle(unit, what):
    if unit.state is not TrainingState.IDLE:
        raise RuntimeError("%s: the module is in its %s; call it between forward/backward "
                           "passes" % (what, unit.state.value))


def _units_of(modules, what):
    out = []
    for m in modules:
        u = getattr(m, "_rfsdp_unit", None)
        if not u:
            raise ValueError("%s: %s is not a module fully_shard sharded parameters of"
                             % (what, type(m).__name__))
        out.append(u)
    return out


def _reshard_after_forward(value):
    if value is None:
        return True
    if not isinstance(value, bool):
        raise ValueError("fully_shard: reshard_after_forward must be True or False, got %r (an "
                         "int, FSDP2's reshard to a smaller world, is not supported)" % (value,))
    return value


_CLASSES = {}


def _as_fsdp_module(module):
    cls = type(module)
    if isinstance(module, FSDPModule):
        return
    new = _CLASSES.get(cls)
    if new is None:  # the same name, so code that prints or saves class names sees the user's
        new = type(cls.__name__, (FSDPModule, cls), {"__qualname__": cls.__qualname__,
                                                      "__module__": cls.__module__})
        _CLASSES[cls] = new
    module.__class__ = new


def _collect(module, dims):
    """The parameters of module that no inner fully_shard call claimed, each with
    every place it stands (a parameter tied to several modules is one entry), the
    TPPiece of each (None where not tensor-parallel; dims: the MeshDims of
    fully_shard's mesh, None without one) and their devices. Storage shared in
    ways a shard cannot keep is refused."""
    entries, pieces, index, devices, storages = [], [], {}, set(), []
    for owner_name, owner in module.named_modules():
        for attr, p in owner._parameters.items():
            if p is None or shard_info(p) is not None:  # an inner call's shard
                continue
            fqn = (owner_name + "." if owner_name else "") + attr
            if is_dtensor(p) and dims is None and id(p) not in index:
                raise ValueError(
                    "fully_shard: parameter '%s' is a DTensor with placements %s over mesh dims "
                    "%s (tensor parallelism): give fully_shard the data-parallel dims of the "
                    "mesh its tp mesh was sliced from, a mesh with dim names (mesh=mesh['dp'], "
                    "or mesh=mesh['dp_replicate', 'dp_shard'] for HSDP), not a process group "
                    "or a mesh without names"
                    % (fqn, tuple(p.placements), tuple(p.device_mesh.mesh_dim_names or ())))
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
            piece = TPPiece(fqn, p, dims) if is_dtensor(p) else None
            t = local(p)  # (a tp piece is planned and sharded as its local tensor)
            if t.numel() > 0 and t.device.type != "meta":  # meta tensors have no memory
                lo = t.data_ptr()
                hi = lo + t.numel() * t.element_size()
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
            pieces.append(piece)
            devices.add(t.device)
    return entries, pieces, devices


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
        lines.append("parameter '%s': shape %s, %s on %s, requires_grad %s, %s, %d uses%s"
                     % (fqn, list(p.shape), p.dtype, p.device.type, p.requires_grad, layout,
                        len(uses), ", placements %s over %s" % (
                            tuple(p.placements), p.device_mesh.mesh_dim_names)
                        if is_dtensor(p) else ""))
    lines.append("mixed precision %s, reshard_after_forward %s, planner %s"
                 % (mp, reshard_after_forward, planner))
    for name, m in module.named_modules():
        if m is not module and getattr(m, "_rfsdp_call", None) is not None \
                and getattr(m, "_rfsdp_unit", None) is not None:
            lines.append("inner fully_shard of '%s': call %d" % (name, m._rfsdp_call))
    return lines


def _inner_units(module, pol):
    """Every unit of an inner fully_shard call below `module`, with the names
    `module` gives its parameters (the model's named_parameters() at the
    outermost call: the shards take them, so errors name parameters as the model
    does) and, where this call's policy is the one the unit was planned with and
    finds logical blocks (Muon's split) under those names that the unit's plan
    lacks, the names to plan it again with (None: no replan): a policy keyed by
    the model's names works under the bottom-up pattern. Also the lines that all
    ranks must agree on (a replan is collective)."""
    out, lines = [], []
    for prefix, m in module.named_modules():
        u = getattr(m, "_rfsdp_unit", None)
        if m is module or not u:
            continue
        names = [prefix + "." + n for n in u.local_names]
        policy_names = list(u.policy_names)
        replan = False
        if u.policy is pol and getattr(pol, "_blocks", None) is not None:
            for i, (name, up) in enumerate(zip(names, u.params)):
                meta = torch.empty(up.sharded._rfsdp_shard.global_shape, device="meta")
                want = pol.blocks(name, meta)
                if want is None:
                    continue
                want, have = (tuple(want), pol.blocks_dim), u.planned_blocks[i]
                if have is None:
                    policy_names[i], replan = name, True
                elif have != want:
                    raise ValueError(
                        "fully_shard: the policy gives parameter '%s' the logical blocks %s "
                        "(split_dim %d) under that name and %s (split_dim %d) under '%s': give "
                        "one of them" % (name, list(want[0]), want[1], list(have[0]), have[1],
                                         u.policy_names[i]))
        if replan:
            lines.append("plan again the unit of '%s' for the blocks of %s" % (
                prefix, [n for n, o in zip(policy_names, u.policy_names) if n != o]))
        out.append((u, names, policy_names if replan else None))
    return out, lines


def _agree(module, comms, lines):
    """One small collective per group: every rank's lines must be equal; if not,
    every rank raises a ValueError naming the first difference and the ranks."""
    for comm in comms:
        if comm is not None and comm.size() > 1:
            _C.agree_lines(comm, lines, "fully_shard(%s)" % type(module).__name__)


def fully_shard(module: nn.Module, *, mesh=None, process_group=None, replicate_group=None,
                policy=None, mp_policy: Optional[MixedPrecisionPolicy] = None,
                reshard_after_forward: Optional[bool] = True,
                planner: Optional[PlannerOptions] = None, shard_placement_fn=None,
                offload_policy=None, ignored_params=None, comm_policy=None) -> nn.Module:
    """Shards the parameters of `module` that no inner fully_shard call claimed
    (apply bottom-up, like FSDP2's fully_shard). Returns the module, now an FSDPModule.

    Groups: process_group (default: torch.distributed's default group) shards
    every unit. HSDP: replicate_group holds the ranks with equal shards (one per
    shard group), or mesh, a DeviceMesh as FSDP2 takes it: 1-D shards over its
    ranks, 2-D (replicate, shard) shards along dim 1 and replicates along dim 0.
    Gradients reduce-scatter inside the shard group and all-reduce across the
    replicas (the mean over every rank); optimizers and clipping work inside the
    shard group. policy: rfsdp.policy (the row granules each optimizer needs; it
    is what FSDP2's shard_placement_fn would say). planner: rfsdp.PlannerOptions
    (how many flat buffers, each with its own collective, a unit may take).
    comm_policy: rfsdp.CommPolicy (the weights' all-gather as int8 or float8 block
    codes, the gradients in bfloat16 summed in float32); with quantised weights the
    plan's granules keep every weight_block whole on one rank (policy combined with
    rfsdp.policy.blockwise_8bit(weight_block))."""
    if shard_placement_fn is not None:
        raise ValueError("fully_shard: shard_placement_fn is not supported: the planner places "
                         "rows; say what must stay whole with policy=rfsdp.policy...")
    if offload_policy is not None and type(offload_policy).__name__ != "OffloadPolicy":
        raise ValueError("fully_shard: CPU offload (offload_policy) is not supported")
    if ignored_params:
        raise ValueError("fully_shard: ignored_params is not supported: keep such parameters in "
                         "a module outside the sharded one")
    if comm_policy is not None and not isinstance(comm_policy, _C.CommPolicy):
        raise ValueError("fully_shard: comm_policy must be an rfsdp.CommPolicy, got %r" % (comm_policy,))
    if getattr(module, "_rfsdp_unit", None) is not None:
        raise ValueError("fully_shard was already applied to this %s" % type(module).__name__)
    reshard_after_forward = _reshard_after_forward(reshard_after_forward)
    pg, rg = _groups(mesh, process_group, replicate_group)
    pol = policy if policy is not None else policy_mod.adamw()
    if comm_policy is not None and comm_policy.quantised_weights():
        # each rank encodes whole blocks of its own rows: the plan keeps them whole
        pol = policy_mod.combine(pol, policy_mod.blockwise_8bit(comm_policy.weight_block))
    dims = MeshDims(mesh, pg, rg) if mesh is not None and mesh.mesh_dim_names else None
    entries, pieces, devices = _collect(module, dims)
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
    inner_units, replan_lines = _inner_units(module, pol)
    _agree(module, (comm, replicate_comm),
           _describe(module, call, entries, pol, mp_policy, reshard_after_forward, planner)
           + ["communication %r" % (comm_policy,)] + replan_lines)
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
    for u, names, policy_names in inner_units:
        if policy_names is not None:
            u.replan(policy_names)
        u.rename(names)
    mp = mp_policy
    if mp is None:  # GPUs compute in bfloat16 and reduce in float32 by default
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if device.type == "cuda" \
            else MixedPrecisionPolicy()
    unit = Unit(entries, comm, replicate_comm, pg, rg, pol, mp, reshard_after_forward, planner,
                device, comm_policy, pieces, dims) if entries else None
    module._rfsdp_unit = unit if unit is not None else False
    # This call's schedule takes over the units of the calls below it (their
    # schedules are emptied). Its pre-hook runs before the unit's, its post-hook after.
    inner = units(module)
    schedule = None
    if len(inner) > 1:
        for u in inner:
            if u.schedule is not None:
                u.schedule.units = []
        schedule = Schedule(inner)
        module.register_forward_pre_hook(schedule.root_pre_forward)
    if unit is not None:
        module.register_forward_pre_hook(unit.pre_forward, with_kwargs=True)
        module.register_forward_hook(unit.post_forward)
    if schedule is not None:
        module.register_forward_hook(schedule.root_post_forward)
    state_dict_mod.install(module)
    _as_fsdp_module(module)
    return module


def units(model: nn.Module) -> List[Unit]:
    return [m._rfsdp_unit for m in model.modules() if getattr(m, "_rfsdp_unit", None)]


def set_prefetch(model: nn.Module, enabled: bool) -> None:
    """Turns the all-gather prefetch of model's units on (the default) or off
    (each unit then gathers when it starts: no overlap; for measurements)."""
    us = units(model)
    if not us:
        raise ValueError("set_prefetch: the model has no fully_shard units")
    for u in us:
        if u.schedule is not None:
            u.schedule.prefetching = bool(enabled)


def clip_grad_norm_(model: nn.Module, max_norm: float, error_if_nonfinite: bool = True) -> torch.Tensor:
    """Clips the sharded gradients of all of model's units by their global L2
    norm (one all-reduce, in C++); returns the norm, a 0-D float32 tensor on the
    parameters' device as torch.nn.utils.clip_grad_norm_ returns it (which, over
    model.parameters(), gives the same: see grad_norm)."""
    us = units(model)
    if not us:
        params = [p for p in model.parameters() if p.grad is not None]
        if params and all(is_dtensor(p) for p in params):
            return _clip_dtensor_grads(params, float(max_norm), bool(error_if_nonfinite))
        raise ValueError("clip_grad_norm_: the model has no fully_shard units (nor torch FSDP2 "
                         "DTensor parameters with gradients)")
    if any(piece is not None for u in us for piece in u.pieces):
        return _clip_tp_units(us, float(max_norm), bool(error_if_nonfinite))
    norm = _C.clip_grad_norm([u.unit for u in us], float(max_norm), bool(error_if_nonfinite))
    return torch.tensor(norm, dtype=torch.float32, device=us[0].sharded[0].device)


def _clip_dtensor_grads(params, max_norm, error_if_nonfinite):
    """clip_grad_norm_ of DTensor parameters (torch FSDP2, with tensor parallelism:
    norms over dp alone, matrices over (dp, tp))."""
    roots = {id(root_mesh(p.device_mesh)): root_mesh(p.device_mesh) for p in params}
    if len(roots) > 1:
        raise ValueError("clip_grad_norm_: the parameters' DTensors lie on %d different device "
                         "meshes; clip each mesh's parameters on their own" % len(roots))
    grads = []
    for p in params:
        g = p.grad
        if not is_dtensor(g) or any(not (is_sharded(x) or x.is_replicate()) for x in g.placements):
            raise ValueError("clip_grad_norm_: the gradient of a parameter with placements %s is "
                             "%s; it must be a DTensor of Shard or Replicate placements (reduced)"
                             % (tuple(p.placements), tuple(g.placements) if is_dtensor(g)
                                else "a plain tensor"))
        sharded = 1
        for d, x in enumerate(g.placements):
            sharded *= g.device_mesh.size(d) if is_sharded(x) else 1
        grads.append((local(g), sharded))
    return _clip_over_mesh(next(iter(roots.values())), grads, max_norm, error_if_nonfinite)


def _clip_tp_units(us, max_norm, error_if_nonfinite):
    """clip_grad_norm_ of fully_shard units over tensor-parallel modules: each
    shard's gradient rows, sharded over its ShardInfo's group (dp, or dp and tp)."""
    if any(u.mesh_dims is None for u in us):
        raise ValueError("clip_grad_norm_: some of the model's fully_shard units were given a "
                         "process group, not a mesh, beside tensor-parallel ones; give every "
                         "fully_shard call its mesh (mesh=mesh['dp'])")
    roots = {id(u.mesh_dims.root): u.mesh_dims.root for u in us}
    if len(roots) != 1:
        raise ValueError("clip_grad_norm_: the model's fully_shard units lie on %d different "
                         "device meshes; clip each mesh's units on their own" % len(roots))
    grads = [(sp.grad, sp._rfsdp_shard.process_group.size()) for u in us for sp in u.sharded
             if sp.grad is not None]
    return _clip_over_mesh(next(iter(roots.values())), grads, max_norm, error_if_nonfinite)


def _clip_over_mesh(root, grads, max_norm, error_if_nonfinite):
    """The L2 norm of gradients [(local tensor, number of ranks its tensor is sharded
    over)] over every rank of the mesh `root` in one all-reduce, each element
    counted once (a piece that k ranks hold alike, along a Replicate dimension or
    outside a parameter's sub-mesh, adds 1/k of its square on each), float64 sums;
    the local gradients scaled in place."""
    # (on the gradients' device: NCCL reduces GPU tensors; one sync, at .item())
    device = grads[0][0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g, sharded in grads:
        holders = root.size() // sharded  # ranks holding each element alike
        total += g.detach().double().pow(2).sum() / holders
    if root.size() > 1:
        dist.all_reduce(total, group=whole_mesh_group(root))
    norm = total.sqrt()
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError("clip_grad_norm_: the total norm of the gradients is %s (on every "
                           "rank); pass error_if_nonfinite=False to clip anyway" % norm.item())
    coef = min(1.0, max_norm / (norm.item() + 1e-6))
    with torch.no_grad():
        for g, _ in grads:
            g.mul_(coef)
    return torch.tensor(norm.item(), dtype=torch.float32, device=device)


def global_numel(model: nn.Module) -> int:
    """The number of elements of model's parameters as one process holds them
    (each tied parameter once); p.numel() of a shard counts only this rank's rows."""
    total = 0
    for p in model.parameters():
        info = shard_info(p)
        total += info.global_numel if info is not None else p.numel()
    return total


def full_parameters(model: nn.Module, process_group=None) -> dict:
    """{name: full tensor} of a fully sharded model's parameters, on every rank
    (one all-gather of every rank's rows per shard group, as a full state dict
    gathers a unit). For checks and small-model checkpoints: it holds the whole
    model on every rank."""
    out, by_group = {}, {}
    for name, p in model.named_parameters():
        info = shard_info(p)
        if info is None:
            out[name] = p.detach().clone()
            continue
        pg = process_group or info.process_group or dist.group.WORLD
        by_group.setdefault(pg, []).append((name, p, info))
    for pg, items in by_group.items():
        full = full_rows([(p, info) for _, p, info in items], pg)
        out.update((name, t) for (name, _, _), t in zip(items, full))
    return {name: out[name] for name, _ in model.named_parameters()}
