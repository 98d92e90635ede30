"""Reading DCP checkpoints without running code from them.

DCP reads its .metadata with a plain pickle.load and its non-tensor values with
torch.load(weights_only=False), so a crafted checkpoint could run anything (the
SHA-256 sums of rfsdp.checkpoint are no defence: whoever writes the folder
recomputes them). Here .metadata is read through an unpickler that knows only
DCP's metadata classes, torch sizes, dtypes and layouts (SafeFileSystemReader),
and non-tensor values with torch's weights-only unpickler (SafeLoadPlanner);
anything else is refused (UnsafeCheckpointError) before it is built.
load(state_dict, path) reads any DCP checkpoint (an FSDP2 one too) so."""
import collections
import enum
import functools
import io
import os
import pathlib
import pickle

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from .layout import default_group


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this model and optimizer (nothing was changed)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint whose files name code or objects that loading would build (a
    crafted or foreign pickle): refused before anything was built."""


@functools.lru_cache(maxsize=None)
def _dcp_classes():
    """{(module, name): object} a DCP .metadata pickle may name: the metadata
    dataclasses, the storage info, torch sizes, dtypes and the layout decoder,
    paths, and plain containers."""
    allowed = {}
    for mod in (dcp_metadata, dcp_filesystem):
        for name in dir(mod):
            obj = getattr(mod, name)
            if isinstance(obj, type) and getattr(obj, "__module__", None) == mod.__name__ and \
                    (hasattr(obj, "__dataclass_fields__") or issubclass(obj, enum.Enum)):
                allowed[(mod.__name__, name)] = obj
    for name in dir(torch):
        obj = getattr(torch, name, None)
        if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = obj
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("pathlib", "PosixPath")] = pathlib.PosixPath
    allowed[("pathlib", "WindowsPath")] = pathlib.WindowsPath
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    allowed[("builtins", "getattr")] = _enum_member
    return allowed


def _enum_member(cls, name):
    """pickle's getattr(enum class, member): for allowed enums' members only (a free
    getattr would reach any object's attributes, and from there anything)."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and name in cls.__members__:
        return cls.__members__[name]
    raise UnsafeCheckpointError("getattr(%r, %r) is not an enum member" % (cls, name))


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that builds only the objects in `allowed` (and plain values)."""

    def __init__(self, f, allowed, where):
        super().__init__(f)
        self.allowed, self.where = allowed, where

    def find_class(self, module, name):
        obj = self.allowed.get((module, name))
        if obj is None:
            raise UnsafeCheckpointError(
                "%s names %s.%s, which it never holds when written by DCP or rfsdp: refused "
                "(loading it could run code); nothing was loaded" % (self.where, module, name))
        return obj

    def persistent_load(self, pid):
        raise UnsafeCheckpointError("%s holds a persistent reference: refused" % self.where)


def read_metadata(path):
    """A DCP checkpoint folder's Metadata, read through the restricted unpickler
    (UnsafeCheckpointError for anything but DCP's metadata)."""
    where = "checkpoint %s: .metadata" % path
    with open(os.path.join(path, ".metadata"), "rb") as f:
        try:
            md = RestrictedUnpickler(f, _dcp_classes(), where).load()
        except UnsafeCheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 (a damaged or foreign file)
            raise CheckpointError("%s is unreadable (%s: %s)" % (where, type(e).__name__, e)) from None
    if not isinstance(md, dcp_metadata.Metadata):
        raise UnsafeCheckpointError("%s holds a %s, not DCP metadata: refused"
                                    % (where, type(md).__name__))
    return md


class SafeFileSystemReader(dcp.FileSystemReader):
    """dcp.FileSystemReader whose .metadata is read by read_metadata (no code runs;
    a file naming anything else is refused before DCP touches it)."""

    def read_metadata(self, *args, **kwargs):
        if kwargs.get("rank") is not None:  # per-rank metadata files: not written by rfsdp
            raise CheckpointError("SafeFileSystemReader: per-rank metadata is not supported")
        md = read_metadata(str(self.path))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = getattr(self, "load_id", None)
        return md


def why_refused(e):
    """The line of torch's weights-only error that says what it refused."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return next((x for x in lines if "GLOBAL" in x or "Unsupported" in x), lines[0] if lines else "")


def weights_only_load(data, where):
    """torch.load(weights_only=True) of bytes or a file; refused:
    UnsafeCheckpointError naming what torch refused."""
    try:
        return torch.load(io.BytesIO(data) if isinstance(data, bytes) else data, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError("%s: refused by torch's weights-only unpickler (%s); "
                                    "nothing was loaded" % (where, why_refused(e))) from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with non-tensor values read by torch's
    weights-only unpickler (plain values, tensors) instead of
    torch.load(weights_only=False)."""

    def load_bytes(self, read_item, value):
        fqn = read_item.dest_index.fqn
        obj = weights_only_load(value, "checkpoint value '%s'" % fqn)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # noqa: PLC0415
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _unwrap(e):
    """The CheckpointError inside DCP's CheckpointException (the one a rank raised),
    else None."""
    for exc, _ in getattr(e, "failures", {}).values():
        if isinstance(exc, CheckpointError):
            return exc
    return None


def failure(what, path, e):
    """One message for a save or load that failed in the file system or in DCP (the
    same on every rank: DCP hands every rank the same exception)."""
    if isinstance(e, dcp.api.CheckpointException):
        why = "; ".join("rank %d: %s: %s" % (r, type(x[0]).__name__, x[0])
                        for r, x in sorted(e.failures.items()))
    else:
        why = "%s: %s" % (type(e).__name__, e)
    if what == "load":
        return CheckpointError("checkpoint.load of %s failed (%s); nothing was loaded" % (path, why))
    return CheckpointError(
        "checkpoint.%s of %s failed (%s); a read-only or full file system? Nothing was replaced: "
        "the checkpoint there before, if any, is whole and loadable" % (what, path, why))


def read(state_dict, path, pg, planner=None):
    """dcp.load through SafeFileSystemReader and SafeLoadPlanner (or planner). DCP
    hands every rank the same failures: a refusal of rfsdp's is raised as it is,
    anything else as one CheckpointError."""
    try:
        dcp.load(state_dict, storage_reader=SafeFileSystemReader(path),
                 planner=planner if planner is not None else SafeLoadPlanner(), process_group=pg,
                 no_dist=pg is None)
    except dcp.api.CheckpointException as e:
        inner = _unwrap(e)
        raise inner if inner is not None else failure("load", path, e) from None


def load(state_dict, path, *, process_group=None, planner=None):
    """dcp.load(state_dict) from the folder `path` without running code from it: its
    .metadata checked first (UnsafeCheckpointError naming what it refused: inside
    dcp.load the reader's errors are caught and replaced by DCP's own), then read by
    SafeFileSystemReader, non-tensor values by SafeLoadPlanner (or `planner`). For
    any DCP checkpoint: a plain model's, an FSDP2 model's, rfsdp's."""
    path = os.path.abspath(str(path))
    read_metadata(path)
    read(state_dict, path, default_group(process_group), planner)
