"""The base of rfsdp.optim's optimizers: _OverCpp, the torch.optim.Optimizer over
one C++ optimizer (binding, groups, steps, state and the checkpoint protocol), and
the helpers every optimizer module shares. torch's state-dict format of the
states is rfsdp.dcp's (optim_state)."""
import collections
import json
import math

import torch
import torch.distributed as dist

from .. import _C
from .._comm import make_comm
from ..dcp import optim_state
from ..dcp.layout import default_group
from ..dcp.state_dict_type import state_dict_type
from ..fsdp.dtensor import (info_of, local, local_grad_of, mesh_dims_of, mesh_group, mesh_key,
                             root_dims_sharded)
from ..fsdp.unit import replacements


def _follow_replaced(optimizer, stepped):
    """Puts, into optimizer.param_groups, the shard of every parameter that
    rfsdp.fully_shard replaced after the optimizer was built (or that it was
    given from a list made before sharding): the optimizer steps the shards, as
    accelerate's switch of param_groups does, never the orphans. A parameter that
    already stepped is refused (its state is of the whole tensor). Returns
    whether any was replaced."""
    changed = False
    for g in optimizer.param_groups:
        ps = g["params"]
        for k, p in enumerate(ps):
            new = p
            while getattr(new, "_rfsdp_replaced_by", None) is not None:
                new = new._rfsdp_replaced_by
            if new is p:
                continue
            if id(p) in stepped:
                raise ValueError(
                    "%s: parameter '%s' was sharded by fully_shard after this optimizer stepped "
                    "it (or loaded a state for it), and its state is of the whole tensor: build "
                    "the optimizer after fully_shard (or load its state with rfsdp.checkpoint, "
                    "which reshards)" % (type(optimizer).__name__, p._rfsdp_replaced))
            ps[k] = new
            optimizer.state.pop(p, None)  # (an empty entry torch's defaultdict made)
            changed = True
    if changed:
        seen = set()
        for p in (p for g in optimizer.param_groups for p in g["params"]):
            if id(p) in seen:
                raise ValueError("%s: parameter '%s' is in its param groups twice now that "
                                 "fully_shard's shard took the replaced parameter's place (it was "
                                 "added again with add_param_group?)"
                                 % (type(optimizer).__name__, p._rfsdp_shard.name))
            seen.add(id(p))
    return changed


def _param_names(param_groups):
    """Each parameter's name, in order: the group's param_names (torch.optim takes
    model.named_parameters() since 2.x), else its shard's (fully_shard names it as
    the module of the outermost call does: the model's name), else None."""
    out = []
    for g in param_groups:
        given = g.get("param_names")
        for k, p in enumerate(g["params"]):
            name = given[k] if given is not None and k < len(given) else None
            if name is None:
                info = getattr(p, "_rfsdp_shard", None)
                name = info.name if info is not None else None
            out.append(name)
    return out


def _shard_spec(i, p, name=None):
    """What the C++ optimizers take for a parameter: (its shard descriptor, this
    rank's tensor): fully_shard's shard, an FSDP2 DTensor's local rows (see
    fsdp/dtensor.py), or a plain tensor as its own whole shard; named `name`
    (what errors call it) where known, else 'param i'."""
    name = name or "param %d" % i
    info = info_of(name, p)
    if info is None:  # (a replicated DTensor: its local tensor is the whole)
        return (_C.TensorShard.whole(name, list(p.shape)), local(p.data))
    shard = info.shard if info.name == name else info.shard.renamed(name)
    return (shard, local(p.data))


def _check_policies(optimizer_name, params, checked):
    """The plan policies of fully_shard's parameters, those not in `checked` (ids):
    a name one of them was given (rfsdp.policy.muon(split={name: ...})) that
    matched no parameter is an error here, once sharding is done (a typo would
    leave matrices unsplit). Returns the ids checked now and before."""
    seen = {}
    for p in params:
        pol = getattr(p, "_rfsdp_policy", None)
        if pol is not None and id(pol) not in checked and hasattr(pol, "check_matched"):
            seen.setdefault(id(pol), pol)
    for pol in seen.values():
        pol.check_matched("%s (the plan policy of its parameters)" % optimizer_name)
    return set(checked) | set(seen)


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
        # (meshes compared by mesh_key: their ranks, not their objects)
        placed = [mesh_dims_of(p, info_of("param %d" % i, p)) for i, p in enumerate(params)]
        meshes = {mesh_key(m[0]): m[0] for m in placed if m is not None}
        if len(shard_groups) > 1 and len(meshes) == 1 and \
                next(iter(meshes.values())).ndim > 1 and all(m is not None for m in placed):
            # Tensor or expert parallelism (parameters over (dp, tp), norms over dp
            # alone; FSDP2's DTensors or fully_shard's tp pieces): the pieces of a
            # matrix lie on the ranks along every dim some parameter is sharded on,
            # which agree each step: the whole (dp, tp) mesh; under HSDP x TP one
            # replica's (shard, tp) ranks (replicas step alike).
            root = next(iter(meshes.values()))
            shard_groups = {"mesh": (mesh_group(root, root_dims_sharded(placed, root)), None)}
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


def _check_betas(optimizer_name, group):
    """A group's betas as the C++ options take them, a pair of numbers; else a
    ValueError saying so (pybind11's own was "incompatible constructor arguments")."""
    betas = group.get("betas")
    if betas is None:
        return
    try:
        ok = len(betas) == 2 and all(isinstance(float(b), float) for b in betas)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError("%s: betas must be a pair (beta1, beta2), got %r" % (optimizer_name, betas))


def bool_option(optimizer_name, group, key, default=False):
    """A group's on/off option, True or False (numpy's bools too); anything else
    (None, 0, "yes") a ValueError naming it: pybind11 would read None as False."""
    v = group.get(key, default)
    if isinstance(v, bool) or type(v).__name__ == "bool_":
        return bool(v)
    raise ValueError("%s: group option '%s' must be True or False, got %r"
                     % (optimizer_name, key, v))


def _run_closure(closure):
    """torch.optim's contract: step(closure) re-evaluates the loss with grad enabled."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _agreed(impl, prepare):
    """Runs prepare() (this rank's part of a step before its first collective). If
    it raises (any Exception: a KeyError of a param group that lost a key as much
    as a ValueError), this rank runs the step's collectives with the error (impl's
    step_refused), as the other ranks' impl.step() runs them, so every rank
    raises the same error at once (naming this rank) instead of waiting for this
    one in a collective until the timeout."""
    try:
        prepare()
    except Exception as e:  # noqa: BLE001 (every rank must hear of it)
        impl.step_refused("%s: %s" % (type(e).__name__, e),
                          isinstance(e, (ValueError, TypeError, IndexError, KeyError)))
        raise  # not reached: the step raised


class _Flag:
    __slots__ = ("dirty",)

    def __init__(self):
        self.dirty = True


def _flagging(cls):
    """cls whose mutating methods set the instance's _flag dirty: how the optimizer
    knows opt.state, or a state dict it published, was written without scanning
    every parameter's each step (writes into the tensors need no flag)."""
    def wrap(name):
        base = getattr(cls, name)

        def method(self, *args, **kwargs):
            flag = self.__dict__.get("_flag")
            if flag is not None:
                flag.dirty = True
            return base(self, *args, **kwargs)
        method.__name__ = name
        return method
    names = ("__setitem__", "__delitem__", "clear", "pop", "popitem", "setdefault", "update",
             "__ior__")
    out = type(cls.__name__, (cls,), {n: wrap(n) for n in names})
    out.__module__, out.__qualname__ = __name__, "_Watched" + cls.__name__
    return out


_WatchedState = _flagging(collections.defaultdict)   # opt.state
_WatchedEntry = _flagging(dict)                      # opt.state[p]


def _same_entries(cur, published):
    """Whether a published state dict still holds what was published in it."""
    return len(cur) == len(published) and all(cur.get(k) is v for k, v in published.items())


def _step_value(v, p):
    """A step count written into a state (a tensor or a number): a whole number >= 0."""
    try:
        x = float(v)
    except (TypeError, ValueError, RuntimeError):
        x = float("nan")
    if not (x >= 0 and x == int(x)):
        raise ValueError("optimizer state of a parameter of shape %s: 'step' must be a whole "
                         "number >= 0, got %r" % (tuple(p.shape), v))
    return int(x)


def _plain(v):
    """A group's option as a plain value to compare (a tensor lr: its number)."""
    if torch.is_tensor(v):
        return v.item()
    if isinstance(v, (list, tuple)):
        return tuple(_plain(x) for x in v)
    return v


class _OverCpp(torch.optim.Optimizer):
    """One C++ optimizer over param_groups' parameters (self._impl): built at
    construction (shards and options are checked then, in C++), rebuilt with the
    state carried over when a group is added. It knows every parameter's group; a
    group's options cross to it only when they change (an LR scheduler: compared
    here as plain values), and a step's gradients cross in one call.
    self.state[p] is torch's format and holds the C++ tensors themselves:
    {"step": counted steps, name: tensor, ...}, present once p stepped.

    Like torch.optim, each step works on the tensors the parameters hold then:
    a parameter whose storage was replaced since it was bound (model.to(),
    load_state_dict(assign=True) with swapped tensors, p.data = ...) is rebound,
    and its dtype may change between float32, bfloat16 and float16 (states stay
    float32); one moved to another device rebuilds the C++ optimizer there, the
    state copied over.

    The checkpoint protocol (what rfsdp.checkpoint uses): settings(),
    sharded_state(p) and load_sharded_state(p, state). state_dict() is sharded
    or full as rfsdp.set_state_dict_type(optimizer, kind) says."""

    rounding = "nearest"  # how steps write bfloat16 / float16 parameters back
    # Whether it steps pieces that are no rows of the global tensor, nor of column
    # parts C++ describes (ShardInfo.box): element-wise updates with fp32 state only.
    _takes_boxes = False
    # Param-group keys that shape the C++ optimizer beyond its state: a state
    # dict or checkpoint saved with other values of them is refused.
    _fixed_group_keys = ()
    # The C++ options class of a group's hyperparameters, built from _group_options(group).
    _options_class = None

    def check_saved_groups(self, groups):
        """Raises ValueError, naming the key and both values, where a saved param
        group (state_dict's or a checkpoint's, in this optimizer's group order)
        holds another value of a key that shapes this optimizer (_fixed_group_keys;
        a key a group was saved without has its default)."""
        def value(v):
            return list(v) if isinstance(v, (list, tuple)) else v
        for k, (saved, now) in enumerate(zip(groups, self.param_groups)):
            for key in self._fixed_group_keys:
                a = value(saved.get(key, self.defaults.get(key)))
                b = value(now.get(key, self.defaults.get(key)))
                if a != b:
                    raise ValueError("%s: param group %d was saved with %s=%r, this optimizer has "
                                     "%r: build it with the saved value" % (type(self).__name__, k,
                                                                           key, a, b))

    def _set_groups(self, process_group, timeout_seconds):
        """self.comm, the ranks the C++ optimizer agrees over (_default_comm), and
        self._group, those a state dict is placed over (dcp.layout.default_group)."""
        self._given_group, self._timeout_seconds = process_group, timeout_seconds
        self.comm = _default_comm(process_group, timeout_seconds, self.param_groups)
        self._group = default_group(process_group)

    def _make_impl(self, params):
        """The C++ optimizer over these parameters (in this order)."""
        raise NotImplementedError

    def _group_options(self, group):
        """A group's hyperparameters as _options_class takes them: {name: value}."""
        raise NotImplementedError

    def _all_params(self):
        return [p for g in self.param_groups for p in g["params"]]

    def _group_of(self):
        """{id(parameter): its param group}."""
        return {id(p): g for g in self.param_groups for p in g["params"]}

    def _specs(self, params):
        """The C++ optimizer's (shard, tensor) of these parameters (the bound ones),
        each named as the model names it where known (_param_names)."""
        names = self._names if len(self._names) == len(params) else [None] * len(params)
        specs = [_shard_spec(i, p, n) for i, (p, n) in enumerate(zip(params, names))]
        if not self._takes_boxes:
            for i, (p, n) in enumerate(zip(params, names)):
                info = info_of(n or "param %d" % i, p)
                if info is not None and info.box is not None and info.shard.col_parts == 1:
                    if len(info.box[0]) == 3:  # an expert stack [E, H, I]
                        cut = next(d for d in (1, 2) if info.box[2][d] != info.box[0][d])
                        raise ValueError(
                            "%s: parameter '%s' is an expert stack %s, a DTensor with placements "
                            "%s: its pieces cut each expert along dim %d, which %s does not take "
                            "yet; shard the stack along dim 0 only (FSDP2's default Shard(0) "
                            "where the data-parallel ranks divide each ep rank's experts), or "
                            "give it to rfsdp.optim.AdamW (an optimizer of its own)"
                            % (type(self).__name__, specs[i][0].name, tuple(info.box[0]),
                               tuple(p.placements), cut, type(self).__name__))
                    raise ValueError(
                        "%s: parameter '%s' is a DTensor with placements %s: its pieces are cut "
                        "along dim %d by tensor parallelism (RowwiseParallel's Shard(1)), which "
                        "%s does not take yet; give such parameters to rfsdp.optim.AdamW (an "
                        "optimizer of their own), or shard them along dim 0 (ColwiseParallel)"
                        % (type(self).__name__, specs[i][0].name, tuple(p.placements),
                           next(d for d, (a, b) in enumerate(zip(info.box[2], info.box[0]))
                                if a != b), type(self).__name__))
        return specs

    def _bind(self, force=False):
        stepped = getattr(self, "_stepped", set())
        generation = replacements()
        if generation != getattr(self, "_replacements_seen", None):
            # (only when fully_shard replaced parameters since: O(1) per step otherwise)
            self._replacements_seen = generation
            if _follow_replaced(self, stepped) and getattr(self, "_given_group", None) is None \
                    and hasattr(self, "comm"):
                # the shards' group, as for an optimizer built after (HSDP: the shard group)
                self._set_groups(None, self._timeout_seconds)
        params = self._all_params()
        old = getattr(self, "_bound_params", None)
        if not force and old is not None and len(old) == len(params) and \
                all(a is b for a, b in zip(old, params)):
            return
        self._policies_checked = _check_policies(type(self).__name__, params,
                                                 getattr(self, "_policies_checked", set()))
        if old is not None:  # (what a user did to self.state applies before the state is carried over)
            self._follow_state()
            stepped = self._stepped
        kept = {id(p): self._state_of(p) for p in (old or []) if id(p) in stepped}
        self._bound_params = params
        self._names = _param_names(self.param_groups)
        self._bound_keys = _tensor_keys(params)
        self._index = {id(p): k for k, p in enumerate(params)}
        self._impl = impl = self._make_impl(params)
        impl.set_groups([k for k, g in enumerate(self.param_groups) for _ in g["params"]])
        impl.set_rounding(self.rounding, 0)
        impl.set_track_update(getattr(self, "_track_update", False))
        self._has_step = [impl.state_has_step(k) for k in range(len(params))]
        # The published "step" of each parameter: a 0-D view of this (torch's float32
        # step), so one read finds the counts a user wrote (opt.state[p]["step"].fill_(0)).
        self._steps = torch.zeros(len(params))
        self._steps_written = [0.0] * len(params)
        self._sent = {}  # group index -> the options last sent, as plain values
        self._send_options()
        self._stepped = set()
        self._published = {}  # id(p) -> (the dict self.state[p] holds, its entries as published)
        self._state_flag = getattr(self, "_state_flag", None) or _Flag()
        self._watched_state = None  # the self.state _follow_state last scanned
        for p in params:
            if id(p) in kept:
                self._load_state_of(p, kept[id(p)])
        self._publish()

    def _follow_params(self):
        """Binds the parameters as they are now (before a step): the list (a group
        added, param_groups switched, fully_shard's shards for the parameters it
        replaced) and each parameter's tensor."""
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
            self._impl.set_param(i, local(params[i].data))
        self._bound_keys = keys

    def _follow_state(self, params=None):
        """self.state as torch.optim's users treat it, followed before a step (and
        before the state is read): a parameter whose entry was removed or emptied
        (opt.state.clear(), opt.state = defaultdict(dict), a load of a state dict
        without it) starts over from zero, as in torch's optimizers; an entry set
        to another dict loads its values; a "step" written (fill_, or another
        tensor) sets the step count; a state tensor replaced by another of its
        shape is copied in; any other write (a name added or removed, another
        shape) is an error, never ignored."""
        state, flag = self.state, self._state_flag
        # (nothing written into self.state or a published entry since the last look:
        # nothing to scan; self.state replaced: every parameter's looked at)
        if params is not None or state is not self._watched_state or flag.dirty:
            for p in (self._bound_params if params is None else params):
                cur = state.get(p)
                if id(p) not in self._stepped:
                    if cur:  # a state given to a parameter that has not stepped: loaded
                        self._load_state_of(p, cur)
                        self._publish_one(p)
                    continue
                if not cur:  # removed, replaced by {} or emptied in place
                    self._reset(p)
                    continue
                mine = self._published.get(id(p))
                if mine is not None and cur is mine[0]:
                    if not _same_entries(cur, mine[1]):
                        self._take_writes(p, cur, mine[1])
                    continue
                # another dict: its values are this parameter's state now
                self._load_state_of(p, cur)
                self._publish_one(p)
            if params is None:
                if not isinstance(self.state, _WatchedState):
                    watched = _WatchedState(dict)
                    dict.update(watched, self.state)
                    watched._flag = flag
                    self.state = watched
                self._watched_state = self.state
                flag.dirty = False
        # steps written into the published views (the checkpoint protocol's calls:
        # these parameters' alone)
        if not any(self._has_step):
            return
        if params is None:
            now = self._steps.tolist()
            if now == self._steps_written:
                return
            ks = range(len(now))
        else:
            ks = [self._index[id(p)] for p in params]
            now = {k: float(self._steps[k]) for k in ks}
        for k in ks:
            p = self._bound_params[k]
            if self._has_step[k] and now[k] != self._steps_written[k] and id(p) in self._stepped:
                self._impl.set_step_count(k, _step_value(now[k], p))
                self._steps_written[k] = now[k]

    def _take_writes(self, p, cur, published):
        """Entries of p's published state that a user replaced: copied into the live
        tensors where they can be, else an error naming them (nothing changed)."""
        k = self._index[id(p)]
        what = "%s: opt.state[p] of parameter '%s'" % (type(self).__name__,
                                                        self._names[k] or "param %d" % k)
        if set(cur) != set(published):
            raise ValueError("%s has the entries %s; this optimizer keeps %s: a name added or "
                             "removed cannot be followed (clear the whole entry to start its "
                             "state over)" % (what, sorted(cur), sorted(published)))
        for name, live in published.items():
            new = cur[name]
            if new is live:
                continue
            if name == "step":
                self._impl.set_step_count(k, _step_value(new, p))
                continue
            if not torch.is_tensor(new) or tuple(new.shape) != tuple(live.shape):
                raise ValueError("%s['%s'] was set to %s; it must be a tensor of shape %s (or write "
                                 "into the tensor in place)" % (
                                     what, name, "a tensor of shape %s" % (tuple(new.shape),)
                                     if torch.is_tensor(new) else type(new).__name__,
                                     tuple(live.shape)))
        for name, live in published.items():
            new = cur[name]
            if new is not live and name != "step":
                with torch.no_grad():
                    live.copy_(new)
            dict.__setitem__(cur, name, live)
        if "step" in published:
            self._steps[k] = float(self._impl.step_count(k))
            self._steps_written[k] = float(self._steps[k])

    def _reset(self, p):
        """p's state starts over (as at construction, step 0), unpublished until it
        steps again: what clearing torch's optimizer state does."""
        self._impl.reset_state(self._index[id(p)])
        self._stepped.discard(id(p))
        self._published.pop(id(p), None)

    def _send_options(self):
        """Every group's options to the C++ optimizer, where they changed since they
        were last sent (compared as plain values: nothing crosses otherwise; C++
        checks them: a bad value is a ValueError naming it, and the group keeps its
        previous options)."""
        for k, g in enumerate(self.param_groups):
            if not g["params"]:
                continue  # (a group without parameters: the C++ optimizer has none of it)
            _check_betas(type(self).__name__, g)
            values = {n: _plain(v) for n, v in self._group_options(g).items()}
            if self._sent.get(k) != values:
                self._impl.set_group_options(k, self._options_class(**values))
                self._sent[k] = values
                self._unpublish_renamed(g)

    def _unpublish_renamed(self, group):
        """The group's parameters whose C++ state now has other names (an option that
        shapes the state changed: Hyperball turned on keeps a radius) are published
        again at the next publish, so self.state and state_dict() carry every tensor
        the step uses (a stale entry would leave the radius out of checkpoints)."""
        for p in group["params"]:
            published = getattr(self, "_published", {}).get(id(p))
            k = getattr(self, "_index", {}).get(id(p))
            if published is None or k is None:
                continue
            if set(self._impl.state(k)) != set(published[1]) - {"step"}:
                self._published.pop(id(p), None)

    def state_bytes(self):
        """Bytes of this rank's optimizer state: every tensor its C++ optimizer
        keeps (codes and scales where quantised)."""
        self._bind()
        return self._impl.state_bytes()

    def metrics(self, across_ranks=True):
        """What the last step did: {"step": the optimizer's step it describes (0: none
        yet), "seconds": its wall time on this rank (on a GPU: until its last host
        wait), "seconds_max": the slowest rank's, "bytes_sent": what this rank's
        step collectives sent, "bytes_sent_total": over the ranks, "groups": one
        dict per param group: "matrices_orthogonalised" (Muon: Newton-Schulz runs,
        each matrix or split block once over the ranks), "tiles_preconditioned"
        and "roots_refreshed" (Shampoo: tiles whose direction was preconditioned,
        tiles whose inverse roots were recomputed; SOAP: its eigenbases), and
        "update_rms": the RMS of the step's change of the group's parameters
        (p_after - p_before, learning rate and weight decay included, in float32,
        over the global elements; None where the group did not step or updates are
        not tracked: track_update(True) first)}.

        The step gathers them for free but the update's sums, which need a float32
        copy of this rank's stepping parameters before the step and a pass after
        (memory and time: off unless track_update(True) asks); across_ranks (the default) sums them over the
        optimizer's ranks in one all-reduce, here: then it is collective (every rank
        calls it); across_ranks=False gives this rank's part and costs nothing. A
        parameter every rank holds whole (DDP) counts once per rank in both the
        sum of squares and the elements (its RMS is right; a group mixing it with
        sharded ones weighs it by the world size)."""
        m = self._impl.metrics(bool(across_ranks) and self.comm is not None)
        groups = []
        for k in range(len(self.param_groups)):
            g = m["groups"][k] if k < len(m["groups"]) else dict(
                matrices=0, tiles=0, roots=0, update_sq=0.0, update_numel=0)
            n = g["update_numel"]
            groups.append({"matrices_orthogonalised": g["matrices"],
                           "tiles_preconditioned": g["tiles"], "roots_refreshed": g["roots"],
                           "update_rms": math.sqrt(g["update_sq"] / n)
                           if m["update_tracked"] and n else None})
        return {"step": m["step"], "seconds": m["seconds"], "seconds_max": m["seconds_max"],
                "bytes_sent": m["bytes_sent"], "bytes_sent_total": m["bytes_sent_total"],
                "groups": groups}

    def track_update(self, on=True):
        """Whether each step keeps what metrics()' update_rms needs (off by default:
        a float32 copy of this rank's stepping parameters during the step)."""
        self._track_update = bool(on)
        if getattr(self, "_impl", None) is not None:
            self._impl.set_track_update(self._track_update)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        if getattr(self, "_bound_params", None) is not None:  # a group added later
            self._bind()

    def _state_of(self, p):
        k = self._index[id(p)]
        st = dict(self._impl.state(k))
        if self._has_step[k]:
            st["step"] = torch.tensor(float(self._impl.step_count(k)))
        return st

    def _layout_of(self, p):
        return self._impl.state_layout(self._index[id(p)])

    def _check_state_of(self, p, st):
        """Raises ValueError (nothing changed) unless st can be p's state:
        every name this optimizer keeps, each of its shape."""
        k = self._index[id(p)]
        for name, t in self._impl.state(k).items():
            if name not in st:
                raise ValueError("%s.load_state_dict: the state of a parameter of shape %s lacks "
                                 "'%s' (saved by another optimizer or with other settings? The "
                                 "load restores the saved groups' options: build the optimizer "
                                 "with the options it was saved with, e.g. hyperball off, and "
                                 "change them after the load)"
                                 % (type(self).__name__, tuple(p.shape), name))
            src = st[name]
            if tuple(src.shape) != tuple(t.shape):
                raise ValueError("%s.load_state_dict: '%s' of a parameter has shape %s, this "
                                 "optimizer keeps %s (another world size or block setting?)"
                                 % (type(self).__name__, name, tuple(src.shape), tuple(t.shape)))
        if self._has_step[k] and "step" in st:
            _step_value(st["step"], p)

    def _load_state_of(self, p, st):
        self._check_state_of(p, st)
        k = self._index[id(p)]
        for name, t in self._impl.state(k).items():
            # torch's load_state_dict casts every state tensor to the parameter's dtype
            # (8-bit codes arrive as float32 holding 0..255): the copy casts them back exactly.
            t.copy_(st[name])
        if self._has_step[k]:
            self._impl.set_step_count(k, _step_value(st["step"], p) if "step" in st else 0)
        self._stepped.add(id(p))
        self._published.pop(id(p), None)

    def _publish(self):
        """self.state[p] for every parameter that stepped: made once (its tensors are
        the C++ optimizer's own, its "step" a view of the counts), then only the
        counts follow the C++ ones (one copy for all)."""
        if any(self._has_step):
            self._steps.copy_(torch.tensor([float(c) for c in self._impl.step_counts()]))
            self._steps_written = self._steps.tolist()  # (as float32 holds them)
        for p in self._bound_params:
            if id(p) not in self._stepped:
                continue
            st = self._published.get(id(p))
            if st is None or self.state.get(p) is not st[0]:  # new, or replaced by a load
                self._publish_one(p)

    def _publish_one(self, p):
        k = self._index[id(p)]
        st = _WatchedEntry(self._impl.state(k))
        if self._has_step[k]:
            dict.__setitem__(st, "step", self._steps[k])
            self._steps[k] = float(self._impl.step_count(k))
            self._steps_written[k] = float(self._steps[k])
        st._flag = self._state_flag
        self._published[id(p)] = (st, dict(st))
        if isinstance(self.state, dict):
            dict.__setitem__(self.state, p, st)  # (our own write: no flag)
        else:
            self.state[p] = st

    def _bind_for(self, p):
        """_bind() for a call about parameter p alone: nothing to do where p is bound
        now (its state is current whatever else changed), so the checkpoint
        protocol's per-parameter calls stay O(1) each; p's state as self.state
        says (_follow_state)."""
        k = getattr(self, "_index", {}).get(id(p))
        if k is None or self._bound_params[k] is not p:
            self._bind()
        self._follow_state([p])

    @torch.no_grad()
    def step(self, closure=None):
        """One step of every parameter with a gradient (closure, as torch.optim's:
        re-evaluates the loss first, with gradients enabled)."""
        loss = _run_closure(closure)
        self._step_all()
        return loss

    def _step_all(self):
        """One step: options where they changed, the gradients in one call (C++
        checks them; None: no step, and Muon's C++ takes part in its collectives
        with zeros), then the step (NaN/Inf, any error: every rank raises before
        anything changes)."""
        self._follow_params()
        # (before the agreement: a replicated DTensor's Partial gradient is summed by
        # a collective, which every rank must reach before any can refuse)
        grads = [local_grad_of(p) for p in self._bound_params]

        def prepare():
            self._follow_state()
            self._send_options()
            self._impl.set_grads(grads)
        _agreed(self._impl, prepare)
        self._impl.step()
        self._stepped.update(id(p) for p in self._bound_params if p.grad is not None)
        self._publish()

    # ---- the checkpoint protocol ----

    def settings(self):
        """What shapes this optimizer's states beyond its parameters, as JSON values
        (its type and its C++ config's settings): a checkpoint keeps it and refuses
        to load into an optimizer whose settings differ."""
        out = {"type": type(self).__name__}
        if self._config_class is not None:
            out.update(self.config.settings())
        return out

    # The C++ config class of the settings that shape the state (None: no settings
    # to move between): builds from settings(), less "type".
    _config_class = None

    def requantizable(self):
        """The settings a checkpoint may hold other values of and still load here,
        requantised (rfsdp.checkpoint.load(..., requantize=True))."""
        return set(self._config_class.requantizable) if self._config_class else set()

    def requantized_state(self, p, saved_settings, full):
        """p's state as this optimizer keeps it from a checkpoint's full (unsharded)
        state of p, saved by this type of optimizer with saved_settings (which
        may differ in requantizable() ones): decoded as those settings kept it and
        this rank's part encoded as this optimizer keeps it (within one code of
        the saved values), by the C++ optimizer. For load_sharded_state."""
        self._bind_for(p)
        k = self._index[id(p)]
        saved = self._config_class(**{n: v for n, v in saved_settings.items() if n != "type"})
        out = self._impl.requantized_state(k, saved, {n: t for n, t in full.items() if n != "step"})
        if self._has_step[k] and "step" in full:
            out["step"] = full["step"]
        return out

    def state_layout(self, p):
        """Where each of p's state tensors lies in the global tensor a checkpoint
        keeps, as its C++ optimizer describes it: {name: ("rows", 0, 0, 0, ()) or
        ("sequence", global size, offset, shared, runs)} (rfsdp.dcp.layout)."""
        self._bind_for(p)
        return self._layout_of(p)

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

    def state_dict(self):
        """torch's format: {"state": {index: {name: tensor}}, "param_groups": [...]},
        each group also holding the settings that shape the states
        ("rfsdp_settings": a load into other settings is refused). Sharded
        parameters' states as rfsdp.set_state_dict_type(optimizer, kind) says:
        "sharded" (the default) their global tensors as DCP sees them, a DTensor
        like an FSDP2 parameter's (as torch's optimizers give), else the pieces
        this rank holds of a tensor of the global shape (rfsdp's parameters, block
        scales, tiles), so dcp.save of it, or of get_optimizer_state_dict's,
        writes every rank's part; "full" the full tensors (gathered: collective).
        Collective the first time after the parameters are bound where tiles or
        codes need placing."""
        self._bind()
        self._follow_state()
        self._publish()
        sd = super().state_dict()
        # (torch's are the live dicts; a step is a view of the counts: its own copy)
        sd["state"] = {k: {n: t.clone() if n == "step" else t for n, t in v.items()}
                       for k, v in sd["state"].items()}
        settings = self._settings_json()
        for g in sd["param_groups"]:
            g["rfsdp_settings"] = settings
        return optim_state.place(sd, self._bound_params, self._state_of, self._layout_of,
                                 state_dict_type(self), self._group)

    def load_state_dict(self, state_dict):
        """torch's format (state_dict()'s: a DCP-loaded one, a full one of
        get_optimizer_state_dict(full_state_dict=True) through set_optimizer_state_dict,
        or local tensors of this layout). States saved with other settings are
        refused. A parameter the state dict holds no state for starts over (as
        torch's load does). Whole or not at all: everything is checked before
        anything changes (groups, settings, every state's names and shapes)."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError("%s.load_state_dict: the state dict has %d param groups, this optimizer "
                             "%d. Nothing was loaded" % (type(self).__name__, len(groups),
                                                         len(self.param_groups)))
        for k, (g, now) in enumerate(zip(groups, self.param_groups)):
            if len(g["params"]) != len(now["params"]):
                raise ValueError("%s.load_state_dict: param group %d of the state dict has %d "
                                 "parameters, this optimizer's %d. Nothing was loaded"
                                 % (type(self).__name__, k, len(g["params"]), len(now["params"])))
        self.check_saved_groups(groups)
        saved_settings = {g["rfsdp_settings"] for g in groups if "rfsdp_settings" in g}
        if saved_settings and saved_settings != {self._settings_json()}:
            raise ValueError(
                "%s.load_state_dict: the state was saved by an optimizer with the settings %s; "
                "this one has %s: build it with the saved settings (8-bit blocks, tiles and low-bit "
                "storage shape the states), or move between them with "
                "rfsdp.checkpoint.load(..., requantize=True). Nothing was loaded"
                % (type(self).__name__, sorted(saved_settings)[0], self._settings_json()))
        saved = state_dict["state"]
        self._bind()
        params = self._all_params()
        # Every state as this rank keeps it, checked, before anything changes.
        local_states = optim_state.local_states([saved.get(i) for g in groups for i in g["params"]],
                                                params, self._state_of, self._layout_of,
                                                type(self).__name__)
        for p, st in zip(params, local_states):
            if st:
                try:
                    self._check_state_of(p, st)
                except ValueError as e:
                    raise ValueError("%s. Nothing was loaded" % e) from None
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
        for p, st in zip(self._all_params(), local_states):
            if st:
                self._load_state_of(p, st)
            elif id(p) in self._stepped:
                self._reset(p)  # no saved state: it starts over, as in torch
        self._publish()
