"""Restarts under chaos: the main job's model (examples/train_gpt.py, small) trained
with AdamW8bit and then Shampoo on 2 ranks under torchrun --max-restarts,
checkpointing every few steps and resuming, while ranks are SIGKILLed: inside an
all-gather, inside an optimizer step, inside a checkpoint's writes (before its
marker), after its marker (before it is renamed into place), while loading, and
from outside at random moments. At the end every parameter and every optimizer
state (8-bit codes and scales, Shampoo's factors, roots and failure counts, step
counts) must equal an uninterrupted run's, bit for bit.

    python tests/python/chaos.py --kills 12          # scripts/chaos.sh
Prints the kills (what, where, which rank), the restarts, and the seconds each
kill cost (the chaos run's time over the uninterrupted run's, per kill)."""
import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import torch

from ranks import start_torchrun  # (this script's folder is on sys.path)

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "..", "..", "examples", "train_gpt.py")
WORKER = os.path.join(HERE, "chaos_job.py")
OPTIMIZERS = "adamw8bit,shampoo"
EVENTS = ("gather", "step", "save_write", "save_marker", "load", "external")


def job_args(steps, save_every, seed, out):
    return ["--optimizers", OPTIMIZERS, "--steps", str(steps), "--dim", "64", "--layers", "1",
            "--heads", "2", "--ctx", "32", "--batch", "2", "--seed", str(seed),
            "--precondition-frequency", "2", "--val-every", "100000", "--val-batches", "1",
            "--log-every", "1", "--plot", os.path.join(out, "loss.png"),
            "--final-checkpoint", os.path.join(out, "final")]


def read_text(path):
    with open(path, errors="replace") as f:
        return f.read()


def make_plan(kills, save_every, rng):
    """kills entries, each event at least once when there are enough. The first
    kill comes after the first checkpoint (so every restart resumes from one, and
    a 'load' kill, placed right after another kill, fires in the restart it causes)."""
    first = {"event": "step", "rank": rng.randrange(2), "n": save_every + 1 + rng.randrange(3)}
    rest = list(EVENTS)
    rng.shuffle(rest)
    rest += [rng.choice(EVENTS) for _ in range(max(0, kills - 1 - len(rest)))]
    rest = rest[:kills - 1]
    plan = [first]
    for e in rest:
        if e == "load":
            plan.append({"event": "load", "rank": rng.randrange(2), "n": 1})
        elif e == "save_marker":  # rank 0 writes the marker and renames
            plan.append({"event": e, "rank": 0, "n": 1 + rng.randrange(2)})
        elif e == "save_write":
            plan.append({"event": e, "rank": rng.randrange(2), "n": 1 + rng.randrange(2)})
        elif e == "gather":  # about 4 gathers a step
            plan.append({"event": e, "rank": rng.randrange(2), "n": 4 + rng.randrange(4 * save_every)})
        elif e == "step":
            plan.append({"event": e, "rank": rng.randrange(2), "n": 1 + rng.randrange(2 * save_every)})
        else:
            plan.append({"event": "external", "rank": rng.randrange(2),
                         "delay": rng.uniform(0.0, 0.5)})
    return plan


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_json(path, value):
    """value as JSON at path, whole or not at all (a hidden temporary file renamed over
    it, which the driver's count of done_ files does not see): the driver and the
    ranks read each other's files while they are written, and a done file seen empty
    once let a rank fire the next kill in the same attempt (two kills, one restart)."""
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def drive(proc, chaos_dir, plan, timeout, log):
    """Runs the external kills of the plan while the job runs; returns its output
    (the file `log` start_torchrun wrote it to)."""
    deadline = time.time() + timeout
    while proc.poll() is None:
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError("the chaos run did not finish in %d s; its output so far:\n%s"
                               % (timeout, read_text(log)[-4000:]))
        k = next((k for k in range(len(plan))
                  if not os.path.exists(os.path.join(chaos_dir, "done_%d" % k))), None)
        if k is not None and plan[k]["event"] == "external":
            done = len([f for f in os.listdir(chaos_dir) if f.startswith("done_")])
            p = [read_json(os.path.join(chaos_dir, "progress_%d" % r)) for r in range(2)]
            # both ranks of this attempt (one restart per kill so far) are training
            if all(x and x["attempt"] == done and x["steps"] >= 2 for x in p):
                time.sleep(plan[k]["delay"])
                write_json(os.path.join(chaos_dir, "done_%d" % k),
                           dict(plan[k], attempt=done, steps=p[plan[k]["rank"]]["steps"]))
                try:
                    os.kill(p[plan[k]["rank"]]["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
        time.sleep(0.05)
    return read_text(log)


def final_states(folder):
    """{key: value} of every final checkpoint under folder (each optimizer's), read
    as one process: parameters and optimizer states whole."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = {}
    for name in sorted(os.listdir(folder)):
        with tempfile.TemporaryDirectory() as d:
            dcp_to_torch_save(os.path.join(folder, name), os.path.join(d, "all.pt"))
            sd = torch.load(os.path.join(d, "all.pt"), weights_only=False)
        stack = [(name, sd)]
        while stack:
            prefix, v = stack.pop()
            if isinstance(v, dict):
                stack += [("%s.%s" % (prefix, k), x) for k, x in v.items()]
            else:
                out[prefix] = v
    return out


def run_chaos(kills, steps, save_every, seed, workdir, timeout=1200, log=print):
    rng = random.Random(seed)
    os.makedirs(workdir, exist_ok=True)
    # The uninterrupted run.
    ref_dir = os.path.join(workdir, "ref")
    os.makedirs(ref_dir)
    t0 = time.time()
    ref_log = os.path.join(ref_dir, "output.log")
    ref = start_torchrun(JOB, job_args(steps, save_every, seed, ref_dir), ref_log)
    try:
        ref.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        ref.kill()
        raise
    ref_seconds = time.time() - t0
    if ref.returncode != 0:
        raise RuntimeError("the uninterrupted run failed:\n" + read_text(ref_log)[-4000:])
    # The chaos run.
    chaos_dir = os.path.join(workdir, "chaos")
    os.makedirs(chaos_dir)
    plan = make_plan(kills, save_every, rng)
    with open(os.path.join(chaos_dir, "plan.json"), "w") as f:
        json.dump(plan, f)
    args = job_args(steps, save_every, seed, chaos_dir) + [
        "--checkpoint-dir", os.path.join(chaos_dir, "ck"), "--save-every", str(save_every),
        "--resume"]
    t0 = time.time()
    chaos_log = os.path.join(chaos_dir, "output.log")
    proc = start_torchrun(WORKER, args, chaos_log, restarts=kills + 2,
                         env={"CHAOS_DIR": chaos_dir})
    out = drive(proc, chaos_dir, plan, timeout, chaos_log)
    chaos_seconds = time.time() - t0
    done = [read_json(os.path.join(chaos_dir, "done_%d" % k)) for k in range(len(plan))]
    for k, d in enumerate(done):
        log("kill %2d: %-11s rank %d  (restart %s, after %s steps of that attempt)"
            % (k, plan[k]["event"], plan[k]["rank"], d and d["attempt"], d and d["steps"]))
    last = read_json(os.path.join(chaos_dir, "progress_0"))
    restarts = last["attempt"] if last else None  # the last attempt's restart count
    report = dict(kills=sum(d is not None for d in done), planned=len(plan), restarts=restarts,
                  returncode=proc.returncode, ref_seconds=ref_seconds, chaos_seconds=chaos_seconds,
                  seconds_per_kill=(chaos_seconds - ref_seconds) / max(1, len(plan)),
                  resumed=out.count("resumed from"), output=out,
                  died_loading=sum(k["event"] == "load" for k in plan))
    if proc.returncode != 0:
        report["differences"] = ["the chaos run failed"]
        return report
    want = final_states(os.path.join(ref_dir, "final"))
    got = final_states(os.path.join(chaos_dir, "final"))
    diffs = sorted(set(want) ^ set(got))
    for k in sorted(set(want) & set(got)):
        a, b = want[k], got[k]
        same = (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and
                a.shape == b.shape and torch.equal(a, b)) if torch.is_tensor(a) else a == b
        if not same:
            diffs.append(k)
    report["differences"] = diffs
    report["compared"] = len(want)
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=12)
    ap.add_argument("--steps", type=int, default=40, help="per optimizer")
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args()
    seed = a.seed if a.seed is not None else random.randrange(2 ** 20)
    workdir = a.workdir or tempfile.mkdtemp(prefix="rfsdp-chaos-")
    print("chaos: seed %d, %d kills, %d steps per optimizer (%s), checkpoints every %d, in %s"
          % (seed, a.kills, a.steps, OPTIMIZERS, a.save_every, workdir), flush=True)
    r = run_chaos(a.kills, a.steps, a.save_every, seed, workdir)
    print("kills survived %d of %d planned, restarts %d, resumes %d; uninterrupted %.1f s, "
          "under chaos %.1f s: %.1f s lost per kill"
          % (r["kills"], r["planned"], r["restarts"], r["resumed"], r["ref_seconds"],
             r["chaos_seconds"], r["seconds_per_kill"]))
    if r["differences"] or r["kills"] != r["planned"]:
        print(r["output"][-6000:])
        print("FAILED: %s" % (r["differences"] or "kills that never fired"))
        sys.exit(1)
    print("final parameters and optimizer states: %d tensors and values equal an uninterrupted "
          "run's, bit for bit" % r["compared"])


if __name__ == "__main__":
    main()
