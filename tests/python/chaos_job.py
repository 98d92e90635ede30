"""The main job (examples/train_gpt.py) as a chaos run's worker: torchrun starts
it; it arms the kill points of a plan shared with the driver (tests/python/chaos.py)
and then runs the main job unchanged.

The plan (CHAOS_DIR/plan.json) is a list of kills, taken in order: the first one not
done is armed. A kill names an event, a rank and an occurrence n: the n-th time that
event happens in this process, the rank marks the kill done and SIGKILLs itself.
Events (each a place a real job can die):
  gather        just after starting an all-gather of a unit (the peer is inside it)
  step          inside an optimizer step, before its agreed gate (the peer is in the gate)
  save_write    inside DCP's write of a checkpoint's files (no marker yet)
  save_marker   after the marker is written, before the folder is renamed into place
  load          inside DCP's read of a checkpoint, while resuming
  external      none here: the driver kills the rank from outside at a random moment
Each process also writes CHAOS_DIR/progress_<rank> (its pid, restart number and the
optimizer steps it took) for the driver."""
import json
import os
import runpy
import signal
import sys

import torch.distributed.checkpoint as dcp

import rfsdp
import rfsdp.checkpoint as ckpt
import rfsdp.fsdp.unit as unit_mod
import rfsdp.optim.base as optim_mod  # (the home of _agreed, which every step calls)
from chaos import write_json  # (torchrun runs this file from its folder)

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "..", "..", "examples", "train_gpt.py")
DIR = os.environ["CHAOS_DIR"]
RANK = int(os.environ["RANK"])
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
with open(os.path.join(DIR, "plan.json")) as f:
    PLAN = json.load(f)
counts = {}
steps = [0]


def armed():
    """The first kill of the plan not done yet, with its index (None when all are done)."""
    for k, kill in enumerate(PLAN):
        if not os.path.exists(os.path.join(DIR, "done_%d" % k)):
            return k, kill
    return None, None


def killed_in_this_attempt(k):
    """Whether kill k-1 fired in this attempt: then this process is its survivor,
    alive only until torchrun stops it, and must not fire kill k too (a gather or a
    save it starts in that window would: two kills for one restart)."""
    if k == 0:
        return False
    try:
        with open(os.path.join(DIR, "done_%d" % (k - 1))) as f:
            return json.load(f)["attempt"] >= ATTEMPT
    except (OSError, ValueError, KeyError):
        return False


def event(name):
    counts[name] = counts.get(name, 0) + 1
    k, kill = armed()
    if kill is None or kill["event"] != name or kill["rank"] != RANK or counts[name] != kill["n"]:
        return
    if killed_in_this_attempt(k):
        return
    write_json(os.path.join(DIR, "done_%d" % k), dict(kill, attempt=ATTEMPT, steps=steps[0]))
    os.kill(os.getpid(), signal.SIGKILL)


def progress():
    write_json(os.path.join(DIR, "progress_%d" % RANK),
               {"pid": os.getpid(), "attempt": ATTEMPT, "steps": steps[0]})


def wrap(owner, attr, before):
    real = getattr(owner, attr)

    def wrapped(*args, **kwargs):
        before(*args, **kwargs)
        return real(*args, **kwargs)
    setattr(owner, attr, wrapped)


# gather: start the unit's all-gather (as prefetch and unshard would), then the
# event: a kill there leaves the peer inside the collective.
def start_gather(self):
    if self.pending is None and not self.unit.unsharded():
        self.pending = self.unit.unshard()
        event("gather")


wrap(unit_mod.Unit, "prefetch", before=start_gather)
wrap(unit_mod.Unit, "unshard", before=start_gather)


# step: after this rank's part of the step, before the agreed gate
def counted_agreed(impl, prepare):
    steps[0] += 1
    progress()
    real_agreed(impl, prepare)
    event("step")


real_agreed = optim_mod._agreed
optim_mod._agreed = counted_agreed
wrap(dcp.FileSystemWriter, "write_data", before=lambda *a, **k: event("save_write"))
wrap(dcp.FileSystemReader, "read_data", before=lambda *a, **k: event("load"))


def rename(src, dst):
    if str(src).endswith(".partial"):
        event("save_marker")
    real_rename(src, dst)


real_rename = ckpt.os.rename
ckpt.os.rename = rename

progress()
sys.argv = [JOB] + sys.argv[1:]
runpy.run_path(JOB, run_name="__main__")
assert rfsdp  # the package the job imports: the one patched here
