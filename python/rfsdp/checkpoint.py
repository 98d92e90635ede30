"""rfsdp.checkpoint: save and load sharded models and their optimizers in
torch.distributed.checkpoint's (DCP's) own format, at any world size.

Every rank writes the rows it holds. A parameter's piece (rows [row_begin,
row_end) of the tensor seen as rows) is a rectangular chunk of the global tensor
at offset (row_begin, 0, ...); an [E, H, I] expert stack planned with row_dims=2
and cut inside an expert is up to three chunks (the partial expert before, the
whole experts, the partial expert after). DCP's chunk metadata records them, so
DCP reads back whatever chunks another world size or plan needs, and torch's own
tools read the model part (dcp_to_torch_save, or dcp.load into a full state_dict).

Optimizer states are saved beside: moments and momentum in the parameter's
chunks; 8-bit codes, their block scales, Shampoo's packed factors and roots and
per-tile failure counts as pieces of one global 1-D sequence per tensor (blocks
and tiles never cross a rank, so a rank's piece is contiguous there, and the
sequence is the same at any world size); step counts; hyperparameters and the
settings that shape the states (a load with other settings is an error).

Keys: "model.<fqn>" (as a plain model's {"model": state_dict()}), buffers too;
"optim.<fqn>.<state>", "optim.groups", "optim.settings", "extra".

A save writes into <path>.partial, adds rfsdp.json (a SHA-256 per file) last,
and renames the folder into place, so a save that dies leaves the previous
checkpoint whole. load() checks the files and every tensor's name, shape and
dtype before it reads, reads into fresh tensors, and only then copies into the
model and optimizer: a bad checkpoint changes nothing.

Loading never runs code from the files: they are read by rfsdp.dcp's safe
reader (DCP's .metadata and non-tensor values, refused with
UnsafeCheckpointError where they name anything else), and `extra` in torch's
weights-only format."""
import hashlib
import io
import json
import os
import pickle
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ._comm import check_in, make_comm
from .dcp.layout import default_group, param_entry, state_entries
from .dcp.pieces import Entry, LayoutError, Pieces
from .dcp.reader import (CheckpointError, RestrictedUnpickler, failure, read, read_metadata,
                         weights_only_load, why_refused)

FORMAT = 2          # 2: `extra` in torch's weights-only format (1: a plain pickle)
READS = (1, 2)
MARKER = "rfsdp.json"
# How long save and load wait for every rank to call them (the optimizers' default).
DEFAULT_TIMEOUT_SECONDS = 300.0
STEP_DIR = re.compile(r"^step_(\d+)$")


def _encode_extra(extra):
    """extra in torch's weights-only format; refused at save (not at load) when it
    holds what that format cannot read back."""
    buf = io.BytesIO()
    torch.save(extra, buf)
    data = buf.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError("checkpoint.save: extra must hold plain values (dict, list, tuple, str, "
                         "int, float, bool, None, tensors): a checkpoint never runs code on load, "
                         "and this one would need to (%s)" % why_refused(e)) from None
    return data


def _decode_extra(data, path, fmt):
    if fmt >= 2:
        return weights_only_load(data, "checkpoint %s: extra" % path)
    # Format 1 pickled extra with pickle.dumps: plain values need no globals.
    return RestrictedUnpickler(io.BytesIO(data), {}, "checkpoint %s: extra (saved by an older "
                               "rfsdp)" % path).load()


# ---- the pieces a rank holds ------------------------------------------------------------

def _nest(flat):
    """{"model.a.b": x} -> {"model": {"a.b": x}}: DCP stores the same keys and records
    the nesting, so torch's tools give back {"model": state_dict, ...} as a plain
    model's {"model": model.state_dict()} checkpoint holds."""
    out = {}
    for k, v in flat.items():
        top, _, rest = k.partition(".")
        if rest:
            out.setdefault(top, {})[rest] = v
        else:
            out[top] = v
    return out


def _flat(nested):
    out = {}
    for top, v in nested.items():
        if isinstance(v, dict):
            out.update({"%s.%s" % (top, k): x for k, x in v.items()})
        else:
            out[top] = v
    return out


def _state_dict(entries):
    """The DCP state_dict of the entries: Pieces (what this rank reads and what it
    writes), or the tensor where replicated."""
    return {e.key: e.tensor if e.pieces is None else
            Pieces(e.shape, e.dtype, e.pieces, writes=e.written()) for e in entries}


# ---- what a model and an optimizer hold ---------------------------------------------------

def _model_entries(model):
    out = [param_entry("model." + n, p) for n, p in model.named_parameters()]
    out += [Entry("model." + n, b.shape, b.dtype, tensor=b.detach())
            for n, b in model.named_buffers()]
    return out


def _group_fqns(model, optimizer):
    """Per param group, the model names of its parameters."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in names:
                raise CheckpointError("checkpoint: the optimizer holds a parameter of shape %s that "
                                      "is not one of the model's (built before fully_shard?)"
                                      % (tuple(p.shape),))
        out.append([names[id(p)] for p in g["params"]])
    return out


def _fqns(model, optimizer):
    """(name, parameter) for every parameter of the optimizer, in its order."""
    return [(n, p) for names, g in zip(_group_fqns(model, optimizer), optimizer.param_groups)
            for n, p in zip(names, g["params"])]


def _groups(model, optimizer):
    return [dict({k: v for k, v in g.items() if k != "params"}, params=names)
            for names, g in zip(_group_fqns(model, optimizer), optimizer.param_groups)]


def _optim_entries(model, optimizer):
    out = []
    for fqn, p in _fqns(model, optimizer):
        out += state_entries("optim." + fqn, p, optimizer.sharded_state(p),
                             optimizer.state_layout(p))
    return out


def _entries(model, optimizer):
    """This rank's entries of the model's and the optimizer's state."""
    try:
        entries = _model_entries(model)
        if optimizer is not None:
            entries += _optim_entries(model, optimizer)
    except LayoutError as e:
        raise CheckpointError("checkpoint: %s" % e) from None
    return entries


# ---- files ---------------------------------------------------------------------------------

def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _agree(pg, fn):
    """fn() on rank 0; its result (or its error, raised on every rank) everywhere."""
    box = [None]
    if pg is None or pg.rank() == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as e:  # noqa: BLE001 (sent to every rank, raised there)
            box[0] = ("error", e)
    if pg is not None and pg.size() > 1:
        dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


def _every_rank(pg, fn):
    """fn() on every rank; if it raised on any, the first such rank's error (its
    type and message, naming the rank) is raised on every rank. One all_gather_object."""
    try:
        result, failure = fn(), None
    except (CheckpointError, ValueError, TypeError, OSError) as e:
        result, failure = None, (type(e).__name__, str(e))
    failures = [failure]
    if pg is not None and pg.size() > 1:
        failures = [None] * pg.size()
        dist.all_gather_object(failures, failure, group=pg)
    for rank, f in enumerate(failures):
        if f is not None:
            kind = {"CheckpointError": CheckpointError, "ValueError": ValueError,
                    "TypeError": TypeError}.get(f[0], CheckpointError)
            raise kind(f[1] + ("" if len(failures) == 1 else " (on rank %d)" % rank))
    return result


def _all_called(pg, what, path, timeout_seconds):
    """Every rank of pg called checkpoint.<what> (save or load) of the same folder,
    within timeout_seconds: checked before the first of DCP's collectives, which wait
    on the group's own timeout (torch's default: 30 minutes). Else a CheckpointError
    on this rank (a rank not called cannot say so) or, where ranks name other
    folders, on every rank."""
    if pg is None or pg.size() == 1:
        return
    comm = make_comm(pg, timeout_seconds)
    try:
        check_in(comm, what, timeout_seconds, lines=[path],
                 every="every rank (each rank writes and reads its own shards: rank 0 alone, as "
                       "DDP code often calls it, waits for the others)")
    except RuntimeError as e:
        raise CheckpointError("checkpoint.%s of %s: %s; nothing was %s"
                              % (what, path, e, "written" if what == "save" else "loaded")) from None
    except ValueError as e:
        raise CheckpointError("checkpoint.%s: %s; every rank must name the same folder"
                              % (what, e)) from None
    finally:
        comm.close()


def _recover(path):
    """A save that died between moving the old checkpoint aside and moving the new
    one in left only <path>.old: it is the checkpoint at path."""
    old = path + ".old"
    if not os.path.exists(path) and os.path.isfile(os.path.join(old, MARKER)):
        os.rename(old, path)


def save(path, model, optimizer=None, *, extra=None, process_group=None,
         timeout_seconds=DEFAULT_TIMEOUT_SECONDS):
    """Saves model (and optimizer) into the folder `path`, replacing a checkpoint
    there only once the new one is complete. Collective: every rank calls it
    (timeout_seconds: how long a rank waits for the others to call it).
    extra: plain values (dicts, lists, numbers, strings, tensors: a data position, a
    scheduler's state_dict), returned by load; stored in torch's weights-only
    format, so that loading never runs code. Errors are the same on every rank; a
    save the file system refuses (full, read-only) is a CheckpointError and leaves
    the checkpoint there before as it was."""
    pg = default_group(process_group)
    path = os.path.abspath(path)
    _all_called(pg, "save", path, timeout_seconds)
    tmp = path + ".partial"

    def prepare():  # everything that could fail on one rank alone, before any file changes
        return _entries(model, optimizer), _encode_extra(extra)
    entries, encoded = _every_rank(pg, prepare)
    # (HSDP's first replica writes the shards; an 8-bit block's scale that ranks share, once)
    sd = _state_dict(entries)
    # Non-tensor values as one string or bytes each (DCP would flatten a dict).
    if optimizer is not None:
        sd["optim.groups"] = json.dumps(_groups(model, optimizer))
        sd["optim.settings"] = json.dumps(optimizer.settings())
    sd["extra"] = encoded

    def fresh():
        _recover(path)
        shutil.rmtree(tmp, ignore_errors=True)  # a save that died before
        os.makedirs(tmp)

    def seal():
        files = sorted(f for f in os.listdir(tmp) if f != MARKER)
        marker = {"format": FORMAT, "files": {f: _sha256(os.path.join(tmp, f)) for f in files},
                  "world_size": 1 if pg is None else pg.size(),
                  "optimizer": None if optimizer is None else optimizer.settings()}
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(marker, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        old = path + ".old"
        if os.path.exists(path):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    try:
        _agree(pg, fresh)
        dcp.save(_nest(sd), storage_writer=dcp.FileSystemWriter(tmp),
                 process_group=pg, no_dist=pg is None)
        _agree(pg, seal)
    except (OSError, dcp.api.CheckpointException) as e:
        raise failure("save", path, e) from None
    return path


def verify(path):
    """Checks a checkpoint folder's files against the SHA-256 sums in its marker;
    returns the marker. Raises CheckpointError naming the first bad file."""
    marker_path = os.path.join(path, MARKER)
    if not os.path.isfile(marker_path):
        raise CheckpointError(
            "checkpoint %s: no %s, so its files cannot be checked (not an rfsdp checkpoint, or its "
            "save did not finish); nothing was loaded. A DCP folder that torch wrote (dcp.save, "
            "FSDP2) loads a model unchecked with load(..., check_files=False); for an rfsdp save "
            "that did not finish, load the one before it (rfsdp.checkpoint.latest(root) finds the "
            "newest complete one)" % (path, MARKER))
    try:
        with open(marker_path, "rb") as f:
            marker = json.loads(f.read().decode("utf-8"))
        files = marker["files"]
        if not isinstance(files, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and os.path.basename(k) == k
                and k not in ("", ".", "..") for k, v in files.items()):
            raise ValueError("'files' is not a map of file names to SHA-256 sums")
    except (ValueError, KeyError, TypeError) as e:  # UnicodeDecodeError is a ValueError
        raise CheckpointError(
            "checkpoint %s: %s is unreadable (%s), so its files cannot be checked; nothing was "
            "loaded. Load the checkpoint before it (or, for the model alone and at your own risk, "
            "load(..., check_files=False))" % (path, MARKER, e)) from None
    if marker.get("format") not in READS:
        raise CheckpointError("checkpoint %s: format %r, this rfsdp reads %s"
                              % (path, marker.get("format"), ", ".join(map(str, READS))))
    for name, digest in sorted(files.items()):
        f = os.path.join(path, name)
        if not os.path.isfile(f):
            raise CheckpointError("checkpoint %s: file %s is missing" % (path, name))
        if _sha256(f) != digest:
            raise CheckpointError("checkpoint %s: file %s is damaged (its SHA-256 differs from the "
                                  "one recorded at save: truncated or changed)" % (path, name))
    return marker


def _check_against(path, meta, entries, want_optim):
    """The first key, shape or dtype that differs between the checkpoint's
    metadata and what this model/optimizer holds."""
    md = meta.state_dict_metadata
    if want_optim and "optim.settings" not in md:
        raise CheckpointError("checkpoint %s holds no optimizer state (load with optimizer=None "
                              "for the model alone)" % path)
    for e in entries:
        if e.key not in md:
            kind = "optimizer state" if e.key.startswith("optim.") else "tensor"
            raise CheckpointError("checkpoint %s has no %s '%s' (saved from another model%s?)"
                                  % (path, kind, e.key,
                                     " or optimizer" if kind != "tensor" else ""))
        m = md[e.key]
        size = tuple(getattr(m, "size", ()))
        dtype = getattr(getattr(m, "properties", None), "dtype", None)
        if size != tuple(e.shape):
            raise CheckpointError("checkpoint %s: '%s' has shape %s there, %s here"
                                  % (path, e.key, list(size), list(e.shape)))
        if dtype is not None and dtype != e.dtype:
            raise CheckpointError("checkpoint %s: '%s' has dtype %s there, %s here"
                                  % (path, e.key, dtype, e.dtype))


def _check_settings(path, saved, optimizer):
    now = optimizer.settings()
    if saved != now:
        movable = sorted(optimizer.requantizable())
        raise CheckpointError(
            "checkpoint %s: the optimizer was %s, this one is %s: build it with the saved "
            "settings (8-bit blocks, Shampoo tiles and the like shape the states)%s. Nothing was "
            "loaded" % (path, saved, now, ", or, where only %s differ, load with requantize=True"
                        % ", ".join(movable) if movable else ""))


def _requantized(path, sd, fqn, p, saved, optimizer):
    """p's state in `optimizer` from the saved full state (saved with the
    settings `saved`): the optimizer requantises it."""
    key = "optim.%s." % fqn
    full = {k[len(key):]: v for k, v in sd.items()
            if k.startswith(key) and "." not in k[len(key):]}
    try:
        return optimizer.requantized_state(p, saved, full)
    except ValueError as e:
        raise CheckpointError("checkpoint %s: %s" % (path, e)) from None


def load(path, model, optimizer=None, *, process_group=None, check_files=True, requantize=False,
         timeout_seconds=DEFAULT_TIMEOUT_SECONDS):
    """Loads a checkpoint saved at any world size into model (and optimizer);
    returns the `extra` saved with it (None for others). Collective: every rank
    calls it (timeout_seconds: how long a rank waits for the others to call it).
    Nothing changes unless everything was read. The files are checked first
    against the SHA-256 sums in the folder's rfsdp.json: a folder
    without it, or with a damaged one, is refused. check_files=False loads a
    model without checking its files: how a DCP checkpoint of a plain or FSDP2
    model ({"model": state_dict}, written by torch's dcp.save, with no rfsdp.json)
    loads; an optimizer's state loads only from rfsdp's own checkpoints, always
    checked. requantize=True: an AdamW8bit checkpoint loads
    into an AdamW8bit with another block or min_8bit_size, a Muon one into a Muon
    with another momentum_dtype, momentum_block or momentum_map, a Shampoo or SOAP
    one into one with another basis_dtype, basis_block or basis_map (SOAP: or
    state_dtype): states decoded, then encoded as this optimizer keeps them,
    within one code of each."""
    pg = default_group(process_group)
    path = os.path.abspath(path)
    _all_called(pg, "load", path, timeout_seconds)

    def inspect():
        _recover(path)
        saved, fmt = None, FORMAT
        if check_files or optimizer is not None:
            marker = verify(path)  # (only rfsdp's own checkpoints hold optimizer states)
            saved, fmt = marker.get("optimizer"), marker["format"]
            if optimizer is not None and saved is not None:
                now = optimizer.settings()
                differ = {k for k in set(saved) | set(now) if saved.get(k) != now.get(k)}
                if not (requantize and differ and saved.get("type") == now.get("type")
                        and differ <= optimizer.requantizable()):
                    _check_settings(path, saved, optimizer)
        if not os.path.isfile(os.path.join(path, ".metadata")):
            raise CheckpointError("checkpoint %s: no .metadata (not a DCP checkpoint, or "
                                  "incomplete)" % path)
        return read_metadata(path), saved, fmt
    meta, saved, fmt = _agree(pg, inspect)
    requant = optimizer is not None and saved is not None and saved != optimizer.settings()
    entries = _entries(model, None if requant else optimizer)
    for e in entries:  # read into copies: the live tensors change only at the end
        if e.pieces is None:
            e.live, e.tensor = e.tensor, e.tensor.clone()
        else:
            e.live = [t for _, _, t in e.pieces]
            e.pieces = [(o, s, t.clone()) for o, s, t in e.pieces]
    _agree(pg, lambda: _check_against(path, meta, entries, optimizer is not None))
    sd = _state_dict(entries)
    if requant:  # the saved states whole, on every rank (requantised below)
        for fqn, _ in _fqns(model, optimizer):
            for k, m in meta.state_dict_metadata.items():
                if k.startswith("optim.%s." % fqn) and k.count(".") == fqn.count(".") + 2:
                    sd[k] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    has_extra = "extra" in meta.state_dict_metadata
    if optimizer is not None:
        sd["optim.groups"] = None
        sd["optim.settings"] = None
    if has_extra:
        sd["extra"] = None
    nested = _nest(sd)
    read(nested, path, pg)
    sd = _flat(nested)
    if optimizer is not None:
        if not requant:
            _check_settings(path, json.loads(sd["optim.settings"]), optimizer)
        groups = json.loads(sd["optim.groups"])
        now = _groups(model, optimizer)
        if [g["params"] for g in groups] != [g["params"] for g in now]:
            raise CheckpointError("checkpoint %s: the optimizer's parameter groups differ (saved "
                                  "%d groups over other parameters; nothing was loaded)"
                                  % (path, len(groups)))
        try:
            optimizer.check_saved_groups(groups)
        except ValueError as e:
            raise CheckpointError("checkpoint %s: %s (nothing was loaded)" % (path, e)) from None
        if requant:
            new_states = {fqn: _requantized(path, sd, fqn, p, saved, optimizer)
                          for fqn, p in _fqns(model, optimizer)}
    extra = _decode_extra(sd["extra"], path, fmt) if has_extra else None
    # Everything was read: copy into the live tensors.
    with torch.no_grad():
        for e in entries:
            if e.pieces is None:
                e.live.copy_(e.tensor)
            else:
                for live, (_, _, t) in zip(e.live, e.pieces):
                    live.copy_(t.reshape(live.shape))
    if optimizer is not None:
        loaded = {e.key: e for e in entries}
        for fqn, p in _fqns(model, optimizer):
            if requant:
                st = new_states[fqn]
            else:
                st = optimizer.sharded_state(p)  # the live tensors, now holding the loaded values
                step = loaded.get("optim.%s.step" % fqn)
                if step is not None:
                    st["step"] = step.tensor
            optimizer.load_sharded_state(p, st)
        for g, saved_group in zip(optimizer.param_groups, groups):
            for k, v in saved_group.items():
                if k != "params":
                    g[k] = tuple(v) if isinstance(g.get(k), tuple) else v
    return extra


# ---- a folder of checkpoints ---------------------------------------------------------------

def step_path(root, step):
    return os.path.join(root, "step_%08d" % step)


def latest(root):
    """The newest complete checkpoint under root (step_<n> folders with their
    marker), or None."""
    if not os.path.isdir(root):
        return None
    steps = sorted((int(m.group(1)), d) for d in os.listdir(root)
                   for m in [STEP_DIR.match(d)] if m and os.path.isfile(os.path.join(root, d, MARKER)))
    return os.path.join(root, steps[-1][1]) if steps else None


def save_step(root, step, model, optimizer=None, *, keep_last=None, extra=None, process_group=None,
              timeout_seconds=DEFAULT_TIMEOUT_SECONDS):
    """save() into root/step_<step>; then, once it is complete, removes all but
    the keep_last newest complete checkpoints."""
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int)
                                  or keep_last < 1):
        raise ValueError("save_step: keep_last must be >= 1 (or None: keep all), got %r"
                         % (keep_last,))
    pg = default_group(process_group)
    path = save(step_path(root, step), model, optimizer, extra=extra, process_group=pg,
                timeout_seconds=timeout_seconds)
    if keep_last is not None:
        def prune():
            steps = sorted((int(m.group(1)), d) for d in os.listdir(root)
                           for m in [STEP_DIR.match(d)]
                           if m and os.path.isfile(os.path.join(root, d, MARKER)))
            for _, d in steps[:-keep_last]:
                # The marker first: a folder half removed is never taken for a checkpoint.
                os.remove(os.path.join(root, d, MARKER))
                shutil.rmtree(os.path.join(root, d), ignore_errors=True)
        _agree(pg, prune)
    return path
