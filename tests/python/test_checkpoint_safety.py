"""Loading a checkpoint never runs code, and a save the file system refuses loses
nothing.

Crafted as an attacker would (the SHA-256 marker recomputed, as whoever writes the
folder can): a DCP .metadata that is a pickle calling os.system, and an `extra`
(and a DCP non-tensor value) that does the same. Plain DCP runs them (checked here
as a control: the payload's marker file appears); rfsdp.checkpoint.load, and
dcp.load with rfsdp's SafeFileSystemReader and SafeLoadPlanner, refuse them with
a clear error and the marker file never appears. Checkpoints of the older format
(a plain pickle of plain values as extra) still load.

Saves into a file system that is full (ENOSPC) or read-only (EROFS), on 2 ranks
(a small tmpfs mounted here; where mounting is not allowed, the writes are made
to raise the same errors): every rank raises the same CheckpointError, and the
checkpoint saved before still loads, exactly."""
import contextlib
import builtins
import errno
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import rfsdp
import rfsdp.checkpoint as ckpt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import run_ranks  # noqa: E402


class Payload:
    """Unpickling this runs `touch <path>`."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, ("touch %s" % self.path,))


def model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    opt = rfsdp.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    return model, opt


def reseal(path, **marker_changes):
    """What an attacker does after changing files: new SHA-256 sums in the marker."""
    with open(os.path.join(path, ckpt.MARKER)) as f:
        marker = json.load(f)
    marker["files"] = {n: ckpt._sha256(os.path.join(path, n)) for n in marker["files"]}
    marker.update(marker_changes)
    with open(os.path.join(path, ckpt.MARKER), "w") as f:
        json.dump(marker, f)


def test_a_crafted_metadata_is_refused_before_dcp_reads_it(tmp_path):
    model, opt = model_and_optimizer()
    path = str(tmp_path / "ck")
    ckpt.save(path, model, opt)
    ran = tmp_path / "ran"
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Payload(ran), f)
    reseal(path)
    fresh, fresh_opt = model_and_optimizer(seed=1)
    before = [p.detach().clone() for p in fresh.parameters()]
    with pytest.raises(rfsdp.dcp.UnsafeCheckpointError, match=r"\.metadata names posix\.system"):
        ckpt.load(path, fresh, fresh_opt)
    with pytest.raises(rfsdp.dcp.UnsafeCheckpointError, match="posix.system"):
        rfsdp.dcp.load({"model": fresh.state_dict()}, path)
    # The reader alone inside dcp.load: DCP replaces its error by its own, but refuses.
    with pytest.raises(BaseException, match="metadata is None"):
        dcp.load({"model": fresh.state_dict()}, storage_reader=rfsdp.dcp.SafeFileSystemReader(path),
                 no_dist=True)
    assert not ran.exists(), "the payload ran"
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))
    # The control: torch's own reader runs it (what the restricted reader stops).
    with contextlib.suppress(Exception):
        dcp.FileSystemReader(path).read_metadata()
    assert ran.exists(), "the crafted .metadata is not an attack: this test proves nothing"


def crafted_extra_checkpoint(path, extra_value):
    """A real rfsdp checkpoint whose 'extra' DCP value is extra_value (bytes, or
    any object DCP pickles itself), as a crafted save would write it."""
    model, opt = model_and_optimizer()
    real = ckpt._encode_extra
    ckpt._encode_extra = lambda extra: extra_value
    try:
        ckpt.save(path, model, opt, extra={"step": 1})
    finally:
        ckpt._encode_extra = real


@pytest.mark.parametrize("how", ["pickle_as_extra", "pickle_as_legacy_extra", "dcp_value"])
def test_a_crafted_extra_is_refused_and_runs_nothing(tmp_path, how):
    ran = tmp_path / "ran"
    path = str(tmp_path / "ck")
    if how == "dcp_value":  # DCP itself pickles the object; its loader would unpickle it
        crafted_extra_checkpoint(path, Payload(ran))
        want = r"checkpoint value 'extra'.*weights-only"
    else:
        crafted_extra_checkpoint(path, pickle.dumps(Payload(ran)))
        if how == "pickle_as_legacy_extra":  # as the older format stored extra
            reseal(path, format=1)
            want = r"extra \(saved by an older rfsdp\) names posix\.system"
        else:
            want = r"extra: refused by torch's weights-only unpickler"
    assert not ran.exists()
    fresh, fresh_opt = model_and_optimizer(seed=1)
    before = [p.detach().clone() for p in fresh.parameters()]
    with pytest.raises(rfsdp.dcp.UnsafeCheckpointError, match=want):
        ckpt.load(path, fresh, fresh_opt)
    assert not ran.exists(), "the payload ran"
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters())), "the model changed"
    if how == "dcp_value":  # the control: DCP's default planner runs it
        sd = {"extra": None}
        with contextlib.suppress(Exception):
            dcp.load(sd, storage_reader=rfsdp.dcp.SafeFileSystemReader(path), no_dist=True)
        assert ran.exists(), "the crafted value is not an attack: this test proves nothing"


def test_extra_needing_code_is_refused_at_save_and_plain_extras_load(tmp_path):
    model, opt = model_and_optimizer()
    path = str(tmp_path / "ck")
    extra = {"step": 7, "sched": {"base_lrs": [0.01], "last_epoch": 7}, "t": (1, 2.5),
             "tensor": torch.arange(3), None: [None, True]}
    ckpt.save(path, model, opt, extra=extra)
    with pytest.raises(ValueError, match="extra must hold plain values"):
        ckpt.save(path, model, opt, extra={"obj": Payload(tmp_path / "x")})
    got = ckpt.load(path, model, opt)  # the first save is there, whole
    assert got.keys() == extra.keys() and got["t"] == (1, 2.5) and got[None] == [None, True]
    assert torch.equal(got["tensor"], extra["tensor"]) and got["sched"] == extra["sched"]
    # The older format: extra as a plain pickle of plain values.
    crafted_extra_checkpoint(path, pickle.dumps({"step": 3, "curve": [1.5, 2.0]}))
    reseal(path, format=1)
    assert ckpt.load(path, model, opt) == {"step": 3, "curve": [1.5, 2.0]}


# ---- saves the file system refuses ----------------------------------------------------------

@contextlib.contextmanager
def small_file_system(kib):
    """A tmpfs of `kib` KiB (None where this process may not mount one, or
    RFSDP_TEST_NO_MOUNT=1 asks for the fallback)."""
    d = tempfile.mkdtemp()
    ok = False
    if os.environ.get("RFSDP_TEST_NO_MOUNT") != "1":
        try:
            ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=%dk" % kib, "tmpfs", d],
                                capture_output=True).returncode == 0
        except OSError:
            pass
    try:
        yield d if ok else None
    finally:
        if ok:
            subprocess.run(["umount", d], capture_output=True)
        shutil.rmtree(d, ignore_errors=True)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@contextlib.contextmanager
def refusing_writes(err):
    """Where no tmpfs can be mounted: what the save of ck_new opens for writing (and,
    read-only, the folders it makes) raises err, as the file system would."""
    real_open, real_makedirs = builtins.open, os.makedirs

    def fake_open(file, mode="r", *a, **k):
        if any(c in mode for c in "wax+") and "ck_new" in str(file):
            raise OSError(err, os.strerror(err), str(file))
        return real_open(file, mode, *a, **k)

    def fake_makedirs(name, *a, **k):
        if err == errno.EROFS and "ck_new" in str(name):
            raise OSError(err, os.strerror(err), str(name))
        return real_makedirs(name, *a, **k)
    builtins.open = io.open = fake_open
    os.makedirs = fake_makedirs
    try:
        yield
    finally:
        builtins.open = io.open = real_open
        os.makedirs = real_makedirs


def full_worker(rank, world, root, mounted, how):
    torch.manual_seed(0)
    model = Net()
    rfsdp.fully_shard(model, policy=rfsdp.policy.blockwise_8bit(256))
    opt = rfsdp.optim.AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=16)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    ckpt.save(os.path.join(root, "ck_old"), model, opt, extra={"step": 1})
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    dist.barrier()
    if rank == 0 and mounted:  # the file system turns full, or read-only
        if how == "full":
            with contextlib.suppress(OSError), open(os.path.join(root, "filler"), "wb", 0) as f:
                while True:
                    f.write(b"\0" * 4096)
        else:
            subprocess.run(["mount", "-o", "remount,ro", root], check=True)
    dist.barrier()
    refused = contextlib.nullcontext() if mounted else \
        refusing_writes(errno.ENOSPC if how == "full" else errno.EROFS)
    try:
        with refused:
            ckpt.save(os.path.join(root, "ck_new"), model, opt, extra={"step": 2})
        error = None
    except ckpt.CheckpointError as e:
        error = str(e)
    # The checkpoint before loads, exactly, into a fresh model.
    torch.manual_seed(1)
    fresh = Net()
    rfsdp.fully_shard(fresh, policy=rfsdp.policy.blockwise_8bit(256))
    fresh_opt = rfsdp.optim.AdamW8bit(fresh.parameters(), lr=1e-2, min_8bit_size=16)
    extra = ckpt.load(os.path.join(root, "ck_old"), fresh, fresh_opt)
    exact = extra == {"step": 1} and all(
        torch.equal(saved[n], p.detach()) for n, p in fresh.named_parameters())
    return {"error": error, "exact": exact}


@pytest.mark.parametrize("how,errno_text", [("full", "No space left on device"),
                                            ("read_only", "Read-only file system")])
def test_a_save_into_a_full_or_read_only_file_system_fails_alike_and_loses_nothing(how, errno_text):
    with small_file_system(512) as mounted, tempfile.TemporaryDirectory() as d:
        root = mounted or os.path.join(d, "root")
        os.makedirs(root, exist_ok=True)
        got = run_ranks(full_worker, 2, root, mounted is not None, how)
        if mounted:
            subprocess.run(["mount", "-o", "remount,rw", root], capture_output=True)
    for r, g in enumerate(got):
        assert g["error"] is not None, "rank %d: the save succeeded" % r
        assert g["error"] == got[0]["error"], (r, g["error"], got[0]["error"])
        assert g["exact"], "rank %d: the checkpoint before did not load exactly" % r
    assert errno_text in got[0]["error"] and "Nothing was replaced" in got[0]["error"], got[0]["error"]
