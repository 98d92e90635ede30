"""One fully_shard call's parameters: the unit (FSDP2's parameter group).

The module's parameters become this rank's shards (rows [row_begin, row_end) of
each tensor, views of the unit's local fp32 slice; rfsdp.shard_info(p)
describes them). Forward gathers the full parameters (and reshards after, if
asked); backward gathers again before the module's backward, then reduce-scatters
the unit's gradients into the local gradient slice as soon as its last gradient
lands (a post-accumulate-grad hook on every full parameter counts them). The
reduce runs while backward moves on; it is finished, and its gathered gradient
buffer freed, before the next unit allocates its own, so at most one unit's
gradient buffer is live. The local slice is each shard's .grad (a ShardGrad:
norms of it are global), summed across micro-batches until the optimizer zeroes it.

With gradient sync off (set_requires_gradient_sync(False)) a backward adds into
the unit's full gradient buffer and reduces nothing; the next synced backward
adds to it and reduce-scatters the sum once."""
import enum
import math
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import _C
from .. import policy as policy_mod
from . import trees
from .grad_norm import ShardGrad


def _weak_hook(method):
    """A hook that calls a bound method through a weak reference. A full parameter's
    hook is kept by C++ (its tensor is shared with the unit's buffers), where Python's
    garbage collector cannot see the cycle tensor -> hook -> unit -> tensor: a strong
    bound method kept every sharded model alive after its last reference went."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        m = ref()
        if m is not None:
            return m(*args)
    return hook


class ShardInfo:
    """Where a sharded parameter's rows come from, and the groups it lives in: a
    view of its shard descriptor (`shard`, a _C.TensorShard: the full shape, its
    row geometry, this rank's rows and, from fully_shard's plan, every rank's),
    which the optimizers, clipping and the checkpoint read as it is.
    process_group shards it (the ranks whose rows together make the tensor);
    replicate_group (HSDP; None for plain FSDP) holds the ranks with equal rows.
    global_shape / global_numel are the parameter's; the shard's own shape and
    numel() are this rank's rows. mesh_dims: None, or (root DeviceMesh, names of
    the root dims it is sharded along) where fully_shard was given a mesh: an
    optimizer over shards of several such groups (tensor parallelism) agrees over
    all those dims."""

    __slots__ = ("shard", "process_group", "replicate_group", "box", "mesh_dims")

    def __init__(self, name, global_shape, row_dims, row_begin, row_end, process_group=None,
                 replicate_group=None, rank_rows=()):
        self.shard = _C.TensorShard(name, list(global_shape), row_dims, row_begin, row_end,
                                    list(rank_rows))
        self.process_group = process_group
        self.replicate_group = replicate_group
        self.box = None
        self.mesh_dims = None

    @classmethod
    def of(cls, shard, process_group=None, replicate_group=None, box=None, mesh_dims=None):
        """box: None, or (global shape, offsets, sizes) where the piece is not rows
        of the global tensor (a tensor-parallel column piece: Shard(1) of
        RowwiseParallel, see fsdp/dtensor.py); shard then describes it as rows of
        its column block, for the optimizers that step pieces element-wise."""
        info = cls.__new__(cls)
        info.shard, info.process_group, info.replicate_group = shard, process_group, replicate_group
        info.box = box
        info.mesh_dims = mesh_dims
        return info

    name = property(lambda self: self.shard.name)
    global_shape = property(lambda self: self.shard.shape if self.box is None else list(self.box[0]))
    row_dims = property(lambda self: self.shard.row_dims)
    row_begin = property(lambda self: self.shard.row_begin)
    row_end = property(lambda self: self.shard.row_end)
    row_len = property(lambda self: self.shard.row_len)
    full_rows = property(lambda self: self.shard.full_rows)
    rank_rows = property(lambda self: self.shard.rank_rows)  # [] where unknown
    global_numel = property(lambda self: self.shard.full_rows * self.shard.row_len
                            if self.box is None else math.prod(self.box[0]))

    def _key(self):
        return (self.name, self.global_shape, self.row_dims, self.row_begin, self.row_end)

    def __eq__(self, other):
        return isinstance(other, ShardInfo) and (self._key(), self.box) == (other._key(), other.box)

    def __hash__(self):
        return hash((self._key(), self.box))

    def __repr__(self):
        return "ShardInfo(name=%r, global_shape=%r, row_dims=%d, row_begin=%d, row_end=%d)" % \
            self._key()

    def __reduce__(self):  # groups live in one process: a pickled ShardInfo drops them
        return (ShardInfo.of, (self.shard, None, None, self.box))


@dataclass
class MixedPrecisionPolicy:
    """param_dtype: dtype of the gathered parameters forward and backward run in
    (float32, bfloat16, float16); reduce_dtype: dtype gradients are reduce-scattered
    in; cast_forward_inputs: cast a unit's floating-point tensor inputs (positional
    and keyword, anywhere in a pytree) to param_dtype (as FSDP2 does), so a float32
    batch meets bfloat16 weights."""
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


def shard_info(param: torch.Tensor) -> Optional[ShardInfo]:
    """The ShardInfo of a parameter managed by fully_shard, else None."""
    return getattr(param, "_rfsdp_shard", None)


_REPLACEMENTS = [0]


def replacements() -> int:
    """How many times fully_shard replaced parameters in this process: an optimizer
    looks for parameters it holds that were replaced (and follows them to their
    shards) only when this changed."""
    return _REPLACEMENTS[0]


def _replace(old, new, name):
    """old, a parameter the module held, is now `new` (its shard): an optimizer
    built before (FSDP2's docs say after; accelerate switches param_groups
    itself) follows it there at its next step, never stepping the orphan."""
    old._rfsdp_replaced = name
    old._rfsdp_replaced_by = new
    _REPLACEMENTS[0] += 1


class UnitParam:
    """One parameter of a unit (FSDP2's FSDPParam): its shard (the parameter the
    model holds between passes), its full parameter (a view of the gathered
    buffer, held during forward and backward), and the views of its gradient in
    the full gradient buffer and in the local slice. The views are stable objects
    (the buffers' memory comes and goes under them), made once here, so a
    backward asks the C++ unit nothing per parameter. The full parameter's
    requires_grad follows the shard's (Unit.follow_requires_grad)."""

    def __init__(self, unit, i, requires_grad, pg, rg, piece=None, mesh_dims=None, blocks=None):
        # piece: the TPPiece of a tensor-parallel parameter (its shard lies in the
        # global tensor over dp and tp; forward sees its full piece as a DTensor).
        self.piece = piece
        self.sharded = nn.Parameter(unit.local_param(i), requires_grad=requires_grad)
        info = ShardInfo.of(unit.tensor_shard(i), pg, rg, mesh_dims=mesh_dims) if piece is None \
            else piece.shard_info(unit.tensor_shard(i), blocks)
        self.sharded._rfsdp_shard = info
        full = unit.full_param(i).data
        self.full = nn.Parameter(full if piece is None else piece.wrap(full),
                                 requires_grad=requires_grad)
        self.full_grad = unit.full_grad(i).data
        self.local_grad = unit.local_grad(i)
        self.grad = ShardGrad.of(self.local_grad, info.process_group)  # the shard's .grad once reduced
        self.hooked = False  # the full parameter's post-accumulate-grad hook is registered


class Unit:
    def __init__(self, entries, comm, replicate_comm, pg, rg, pol, mp, reshard_after_forward,
                 planner, device, comm_policy=None, pieces=None, mesh_dims=None):
        # entries[i]: every place parameter i stands, [(owner module, attr name, fqn)];
        # a tied parameter stands in several and is sharded once, under the first name.
        self.entries = entries
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.requires_grad_sync = True
        self.forward_prefetch = None   # units to prefetch at this forward (None: the schedule's)
        self.backward_prefetch = None  # units to prefetch at this backward (None: the schedule's)
        self.process_group = pg
        self.replicate_group = rg
        self.policy = pol
        self.mp = mp
        self.planner = planner
        self.device = device
        self.comm_policy = comm_policy
        self.comm = comm  # kept: rfsdp closes it at exit (see _comm)
        self.replicate_comm = replicate_comm
        # pieces[i]: parameter i's TPPiece (tensor parallelism), or None; mesh_dims: the
        # MeshDims of the mesh fully_shard was given (None: process groups).
        self.pieces = pieces if pieces is not None else [None] * len(entries)
        self.mesh_dims = mesh_dims
        # Each parameter's name in the module this call shards (fixed), and the
        # names the policy was asked under (an outer call's may replace them: replan).
        self.local_names = [uses[0][2] for uses in entries]
        params = [uses[0][0]._parameters[uses[0][1]] for uses in entries]
        # Every rank starts from the values of the shard group's rank 0: one all-reduce
        # of its values and zeros elsewhere (exact; one collective for the whole unit);
        # under HSDP, replica 0's then go to the other replicas (one broadcast).
        # (a tensor-parallel parameter: its local piece, over dp alone)
        local_params = [p if piece is None else p._local_tensor
                        for p, piece in zip(params, self.pieces)]
        flat = torch.cat([p.detach().to(torch.float32).reshape(-1) for p in local_params])
        if pg.size() > 1:
            if pg.rank() != 0:
                flat.zero_()
            dist.all_reduce(flat, group=pg)
        if self.replicate_comm is not None:
            dist.broadcast(flat, src=dist.get_global_rank(rg, 0), group=rg)
        full = [t.view(p.shape) for t, p in zip(flat.split([p.numel() for p in local_params]),
                                                local_params)]
        self._lay_out(full, [p.requires_grad for p in params], list(self.local_names), params,
                      asked=params)
        self.state = TrainingState.IDLE
        self.cast_to = mp.param_dtype if mp.cast_forward_inputs and mp.param_dtype != torch.float32 else None
        self.grads_waiting = 0
        self.grads_done = False  # this backward's gradients are all in (reducing, or kept)
        self.grads_kept = False  # the full gradient buffer holds unreduced gradients (sync off)
        self.reduce_handle = None
        self.pending = None     # handle of a prefetch all-gather not yet waited on
        self.schedule = None    # the Schedule of the outermost fully_shard call above
        self.recomputing = False  # this forward runs inside backward (checkpointing)

    def _lay_out(self, full, requires_grad, names, replaced, asked=None):
        """Plans the unit (the policy asked under `names` about the tensors `asked`,
        default `full`: the model's own parameters when it is first sharded, so a
        policy may know them by identity, as rfsdp.policy.of does), shards the full
        values `full` (every rank's alike) into it and puts the shards into the
        modules; `replaced`: the parameters they replace (marked for optimizers built
        before)."""
        from .tp_pieces import local_blocks
        pg, rg = self.process_group, self.replicate_group
        dtype_bytes = torch.empty((), dtype=self.mp.param_dtype).element_size()
        specs, self.planned_blocks = [], []
        pol = self.policy
        for name, t, here, piece in zip(names, full if asked is None else asked, full,
                                        self.pieces):
            g = pol.granule(name, t)
            row_dims = pol.row_dims(name, t) if t.dim() > 0 else 1
            blocks = pol.blocks(name, t)
            self.planned_blocks.append(None if blocks is None else (tuple(blocks), pol.blocks_dim))
            if piece is not None:  # a tp piece is planned as itself: its blocks and granule
                blocks = local_blocks(blocks, pol.blocks_dim, piece)
                g = piece.granule(g, row_dims, policy_mod.WHOLE)
            specs.append((name, list(here.shape), 0 if g == policy_mod.WHOLE else g, row_dims,
                          dtype_bytes, blocks or [], pol.blocks_dim if blocks else 0))
        self.policy_names = list(names)
        self.plan = _C.plan_specs(specs, pg.size(), options=self.planner)
        # agree=False: fully_shard agreed on all of this (and more) already.
        self.unit = _C.FSDPUnit(self.comm, self.plan, str(self.mp.param_dtype).replace("torch.", ""),
                                str(self.mp.reduce_dtype).replace("torch.", ""),
                                self.replicate_comm, str(self.device), False, self.comm_policy)
        self.unit.shard(full)
        self.params = []
        for i, (uses, old) in enumerate(zip(self.entries, replaced)):
            up = UnitParam(self.unit, i, requires_grad[i], pg,
                           rg if self.replicate_comm is not None else None, self.pieces[i],
                           self._mesh_dims(), self.planned_blocks[i])
            up.sharded._rfsdp_policy = pol  # (the optimizers check its names were all matched)
            _replace(old, up.sharded, uses[0][2])
            self.params.append(up)
        # (the same objects, as lists: what the hooks swap into the modules)
        self.sharded = [up.sharded for up in self.params]
        self.full = [up.full for up in self.params]
        self._requires_grad = None
        self.follow_requires_grad()
        self._use(self.sharded)

    def _mesh_dims(self):
        """(root mesh, the dims this unit shards along) for its ShardInfos, or None."""
        d = self.mesh_dims
        return None if d is None else (d.root, d.shard_dims)

    def rename(self, names):
        """The shards' names become `names` (an outer fully_shard call's: what its
        module calls them), so errors name parameters as the model does."""
        for up, name in zip(self.params, names):
            info = up.sharded._rfsdp_shard
            if info.name != name:
                info.shard = info.shard.renamed(name)

    def replan(self, names):
        """Plans the unit again with the policy asked under `names` (an outer call
        found logical blocks under them that the inner names missed): every
        parameter gathered (one all-gather), laid out anew and sharded; the old
        shards are marked replaced. Collective; only between steps."""
        from ..dcp.gather import full_rows
        if self.state is not TrainingState.IDLE or self.unit.unsharded() or self.pending is not None:
            raise RuntimeError("fully_shard: a unit can be planned again only between steps")
        # (each parameter's rows of the tensor it was planned as: a tp piece's, over dp)
        full = full_rows([(up.sharded, ShardInfo.of(self.unit.tensor_shard(i)))
                          for i, up in enumerate(self.params)], self.process_group)
        full = [t.detach().clone() for t in full]
        # (the policy is asked about the global tensors, as _inner_units asked it)
        asked = [t if piece is None else torch.empty(piece.shape, device="meta")
                 for t, piece in zip(full, self.pieces)]
        self._lay_out(full, [up.sharded.requires_grad for up in self.params], names,
                      self.sharded, asked=asked)

    def follow_requires_grad(self):
        """requires_grad set on the shards after sharding (freezing or unfreezing
        layers: fine-tuning schedules, LoRA-style recipes) reaches the full
        parameters that forward and backward use, as FSDP2 follows it: a frozen
        parameter gets no new gradient (the reduce-scatter leaves its shard's
        gradient as it was), an unfrozen one gets them again. Run before each
        forward (cheap when nothing changed)."""
        now = [sp.requires_grad for sp in self.sharded]
        if now == self._requires_grad:
            return
        for up, rg in zip(self.params, now):
            if up.full.requires_grad != rg:
                up.full.requires_grad_(rg)
            if rg and not up.hooked:
                up.full.register_post_accumulate_grad_hook(_weak_hook(self._grad_landed))
                up.hooked = True
        self._requires_grad = now
        self.grads_expected = sum(now)  # (units missing one reduce at the end of backward)

    # -- nn.Module's conversions (model.to(), .float(), to_empty(), ...) -----
    def check_conversion(self, fn, what):
        """Refuses (before anything changes) a conversion that would take the
        shards off the unit's flat buffers' device or dtype: the collectives read
        and write those buffers, so a shard moved away would stop training."""
        if not self.sharded:
            return
        home = self.unit.local_param(0)
        probe = fn(torch.empty(0, dtype=home.dtype, device=home.device))
        if probe.device != home.device or probe.dtype != home.dtype:
            raise ValueError(
                "%s after fully_shard would move the shards of %s from %s %s to %s %s, away from "
                "the unit's flat buffers its collectives use: move the model to its device "
                "before fully_shard (the shards stay float32 masters); for bfloat16 or float16 "
                "compute, pass mp_policy=rfsdp.MixedPrecisionPolicy(param_dtype=...). Nothing "
                "was changed" % (what, self.entries[0][0][2], home.device, home.dtype,
                                 probe.device, probe.dtype))

    def keep_shards_home(self, had_grads):
        """After a conversion that kept device and dtype (a copy to "cpu:0" is one):
        each shard's values, and its gradient's, back into the unit's flat buffers,
        and the shard and its gradient views of them again (nn.Module re-points a
        gradient's .data too, or gives the shard a new one)."""
        with torch.no_grad():
            for i, up in enumerate(self.params):
                sp = up.sharded
                home = self.unit.local_param(i)
                if sp.data_ptr() != home.data_ptr():
                    home.copy_(sp.data)
                    sp.data = home
                if not had_grads[i]:
                    continue
                if sp.grad.data_ptr() != up.local_grad.data_ptr():
                    up.local_grad.copy_(sp.grad)
                    up.grad = ShardGrad.of(up.local_grad, up.grad._rfsdp_group)
                sp.grad = up.grad

    def data_state(self):
        if self.reduce_handle is not None and not self.reduce_handle.waited():
            return DataState.REDUCING
        if self.pending is not None:
            return DataState.GATHERING
        return DataState.GATHERED if self.unit.unsharded() else DataState.SHARDED

    # -- parameters ------------------------------------------------------------
    def _use(self, tensors):
        for uses, t in zip(self.entries, tensors):
            for owner, attr, _ in uses:
                owner._parameters[attr] = t

    def _wait_pending(self):
        """Finishes a prefetch all-gather in flight; whether there was one."""
        if self.pending is None:
            return False
        self.pending.wait()
        self.pending = None
        return True

    def unshard(self):
        if not self._wait_pending() and not self.unit.unsharded():
            self.unit.unshard().wait()

    def prefetch(self):
        if self.pending is None and not self.unit.unsharded():
            self.pending = self.unit.unshard()

    def _prefetch(self, explicit, step):
        """Starts the gathers of the units this one's forward (step 1) or backward
        (step -1) prefetches: the explicit list, else the schedule's neighbour."""
        targets = self.schedule.targets(self, explicit, step) if self.schedule is not None \
            else explicit or []
        for u in targets:
            if u.state is not TrainingState.BACKWARD:  # already gathered for its backward
                u.prefetch()

    def use_full(self):
        self.unshard()
        self._use(self.full)

    def reshard(self):
        self._wait_pending()
        self._use(self.sharded)
        self.unit.reshard()

    def settle(self):
        """A prefetch this pass did not use: finish it and free the buffer."""
        if self.state is TrainingState.IDLE and self._wait_pending():
            self.unit.reshard()

    # -- forward ---------------------------------------------------------------
    def in_backward(self):
        return self.state is TrainingState.BACKWARD or \
            (self.schedule is not None and self.schedule.in_backward)

    # The hooks run eagerly around a compiled module (torch.compile traces the
    # module's forward, not the collectives and bookkeeping here).
    @torch.compiler.disable
    def pre_forward(self, module, args, kwargs):
        # Inside backward, a forward is activation checkpointing's recomputation
        # (reentrant or not): gather again if needed, but record no order, prefetch
        # nothing, and keep the parameters gathered for the backward that follows.
        self.recomputing = self.in_backward()
        if not self.recomputing:
            self.follow_requires_grad()
            self.state = TrainingState.FORWARD
            if self.schedule is not None:
                self.schedule.forward_started(self)
            self._prefetch(self.forward_prefetch, 1)
        self.use_full()
        if self.cast_to is not None:
            return trees.cast_floating(args, self.cast_to), trees.cast_floating(kwargs, self.cast_to)
        return None

    @torch.compiler.disable
    def post_forward(self, module, args, output):
        self._use(self.sharded)
        if not self.recomputing:
            self.state = TrainingState.IDLE
            if self.reshard_after_forward:
                self.unit.reshard()
        if torch.is_grad_enabled() and self.state is not TrainingState.BACKWARD:
            for t in trees.tensors(output):
                if t.requires_grad:
                    t.register_hook(self._pre_backward_hook)
        return output

    # -- backward --------------------------------------------------------------
    def _pre_backward_hook(self, grad):
        if self.state is not TrainingState.BACKWARD:
            self.state = TrainingState.BACKWARD
            if self.schedule is not None:
                self.schedule.backward_started(self)
            self._prefetch(self.backward_prefetch, -1)
            self.unshard()
            if self.schedule is not None and self.schedule.reducing is not None:
                self.schedule.reducing._finish_reduce()  # its gradient buffer goes first
            self.unit.prepare_grads(keep=self.grads_kept)
            for up in self.params:
                # Backward adds into the gradient view in place; with another reduce
                # dtype it lands in a fresh .grad that _grads_to_buffer adds over.
                # (a tensor-parallel one's: the DTensor over the gradient view)
                if up.full.dtype != up.full_grad.dtype:
                    up.full.grad = None
                else:
                    up.full.grad = up.full_grad if up.piece is None else up.piece.wrap(up.full_grad)
            self.grads_waiting = self.grads_expected
            self.grads_done = False
            torch.autograd.Variable._execution_engine.queue_callback(self._post_backward)
        return None

    def _grad_landed(self, param):
        if self.state is TrainingState.BACKWARD and not self.grads_done:
            self.grads_waiting -= 1
            if self.grads_waiting == 0:
                self._grads_done()

    def _grads_to_buffer(self):
        """Every full gradient into the full gradient buffer (in the reduce dtype)."""
        for up in self.params:
            fp = up.full
            g = fp.grad
            if g is not None and up.piece is not None:
                g = up.piece.grad_piece(g)  # a tensor-parallel piece's gradient: its local piece
            if g is not None and g.data_ptr() != up.full_grad.data_ptr():
                up.full_grad.add_(g)  # mixed precision: gradient dtype != reduce dtype
            fp.grad = None

    def _grads_done(self):
        self.grads_done = True
        if self.requires_grad_sync:
            self._start_reduce()
        else:
            self._grads_to_buffer()
            self.grads_kept = True
            if self.reshard_after_backward:
                self.unit.reshard()

    def _start_reduce(self):
        self._grads_to_buffer()
        self.grads_kept = False
        # The optimizer's zero_grad set .grad to None: tell the unit (it owns "zeroed"),
        # so the reduce-scatter writes straight into the local gradient slice instead
        # of adding a scratch copy. Shards zeroed one by one are zeroed in place. A
        # frozen shard still holding a gradient keeps it (its rows reduce zeros, added).
        trained = [sp for sp in self.sharded if sp.requires_grad]
        if trained and all(sp.grad is None for sp in self.sharded):
            self.unit.zero_grad()
        else:
            for up in self.params:
                if up.sharded.requires_grad and up.sharded.grad is None:
                    up.local_grad.zero_()
        self.reduce_handle = self.unit.reduce_grads(True)
        # Always resharded after a synced backward: the optimizer step that follows
        # changes the shards, and gathered parameters kept would be stale.
        self.unit.reshard()
        if self.schedule is not None:  # one reduce in flight: finish the one before
            if self.schedule.reducing is not None:
                self.schedule.reducing._finish_reduce()
            self.schedule.reducing = self

    def _finish_reduce(self):
        if self.reduce_handle is not None and not self.reduce_handle.waited():
            self.reduce_handle.wait()  # frees the gathered gradient buffer
            for up in self.params:
                if up.sharded.requires_grad:
                    up.sharded.grad = up.grad
        if self.schedule is not None and self.schedule.reducing is self:
            self.schedule.reducing = None

    def _post_backward(self):
        """End of backward: finish this unit's reduce-scatter (.grad = the local
        slice), or, with gradient sync off, keep the gradients unsharded."""
        # A checkpoint's recomputation may stop inside this unit's forward (non-reentrant
        # checkpoints stop once they have what backward needs): put the shards back.
        self._use(self.sharded)
        if not self.grads_done:
            self._grads_done()
        if self.requires_grad_sync:
            self._finish_reduce()
            self.reduce_handle = None
        elif self.reshard_after_backward:
            self.reshard()
        self.state = TrainingState.IDLE
