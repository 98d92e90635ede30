"""One rank of a comparison's training: `python -m rfsdp.compare.worker TODO DIR`
under torchrun (rfsdp.compare's `run` launches it). Trains the runs listed in the
TODO file one after another, each a real sharded run (rfsdp.fully_shard with the
policy its optimizer needs), and writes DIR/runs/<run>.json as each finishes.

A run: the model built from the run's seed (the same weights for every optimizer),
the same batches (each rank's stream seeded by seed * 1000 + rank, as the main job),
the schedule ending at the run's budget, gradients clipped to `clip`, then the loss
on the fixed held-out tokens. It stops early, recorded as diverged, when the mean
training loss over ranks is not finite, when the mean of the last
`divergence_window` steps' losses rises above the first step's, or when a step
raises (rfsdp's optimizers raise the same error on every rank: a NaN gradient, a
root that failed); and so is a run whose final validation loss lies above its
first step's training loss."""
import gc
import importlib
import json
import math
import os
import platform
import resource
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import rfsdp

from . import config as C
from .gpt import GPT, VOCAB, batches, load_text, split_text
from .optimizers import make_optimizer, policy_for


def build_model(model_cfg):
    """The config's model: the main job's GPT, or factory(**the entry's other keys)
    for kind 'callable' (a module from [B, T] int64 tokens to [B, T, 256] logits)."""
    if model_cfg["kind"] == "gpt":
        return GPT(model_cfg["width"], model_cfg["layers"], model_cfg["heads"], model_cfg["ctx"])
    mod, _, fn = model_cfg["factory"].partition(":")
    factory = getattr(importlib.import_module(mod), fn)
    return factory(**{k: v for k, v in model_cfg.items() if k not in ("kind", "factory")})


def shard_model(model, pol):
    """Every block (model.blocks) its own unit, then the root, as FSDP2 users do."""
    for b in getattr(model, "blocks", []):
        rfsdp.fully_shard(b, policy=pol)
    rfsdp.fully_shard(model, policy=pol)


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _reset_peak():
    """Starts this process's peak-memory count over (Linux: VmHWM via clear_refs)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_mib(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _all_gather_floats(values, device):
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def _mean_over_ranks(v, device):
    t = torch.tensor([float(v)], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def validate(model, val, ctx, val_tokens, rank, world, device, chunk=16):
    """Mean cross-entropy over the fixed held-out windows: the first val_tokens // ctx
    windows of the held-out text (rounded down to a multiple of the ranks), rank r
    scoring windows r, r + world, ...; the same tokens for every run."""
    n = (val_tokens // ctx) // world * world
    if n * ctx + 1 > val.numel():
        raise ValueError("val_tokens %d: the held-out text has only %d tokens"
                         % (val_tokens, val.numel()))
    mine = list(range(rank, n, world))
    total = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for i in range(0, len(mine), chunk):
            idx = mine[i:i + chunk]
            x = torch.stack([val[j * ctx:(j + 1) * ctx] for j in idx]).to(device)
            y = torch.stack([val[j * ctx + 1:(j + 1) * ctx + 1] for j in idx]).to(device)
            loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB).float(), y.reshape(-1),
                                               reduction="sum")
            total += torch.stack([loss.double(), torch.tensor(float(y.numel()), dtype=torch.float64,
                                                               device=device)])
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def train_run(cfg, run, train, val, rank, world, device):
    """Trains one run; returns its record (the JSON written for it)."""
    ctx = cfg["model"]["ctx"]
    per_rank = cfg["batch_tokens"] // (world * ctx)
    total = run["steps"]
    window = cfg["divergence_window"]
    gc.collect()
    _reset_peak()
    torch.manual_seed(run["seed"])
    rec = dict(key=run["key"], file=run["file"], optimizer=run["optimizer"], names=run["names"],
               point=run["point"], budget=run["budget"], seed=run["seed"], steps=total,
               steps_done=0, tokens=0, error=None, diverged=False, diverged_step=None, diverged_reason=None,
               val_loss=None, train_loss=None, first_loss=None)
    curve, step_s = [], []
    sums = {}
    model = opt = None
    t_start = time.time()
    phase = "build"
    try:
        model = build_model(cfg["model"]).to(device)
        rec["params"] = sum(p.numel() for p in model.parameters())
        hp = dict(run["point"])
        lr = hp.pop("lr")
        shard_model(model, policy_for(run["optimizer"], model, **hp))
        opt = make_optimizer(run["optimizer"], model, lr, **hp)
        opt.track_update(True)  # (the update's RMS in the metrics: a copy per step, small here)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: C.lr_factor(cfg["schedule"], min(s, total - 1), total))
        gen = torch.Generator().manual_seed(run["seed"] * 1000 + rank)
        data = batches(train, per_rank, ctx, gen, device)
        phase = "train"
        for step in range(1, total + 1):
            x, y = next(data)
            t0 = time.perf_counter()
            loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB).float(), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            if cfg["clip"]:
                rfsdp.clip_grad_norm_(model, cfg["clip"])
            mean = _mean_over_ranks(loss.item(), device)  # the same on every rank
            if not math.isfinite(mean):
                rec.update(diverged=True, diverged_step=step,
                           diverged_reason="training loss not finite (%r) at step %d"
                           % (mean, step))
                break
            curve.append(mean)
            if len(curve) >= window and sum(curve[-window:]) / window > curve[0]:
                rec.update(diverged=True, diverged_step=step,
                           diverged_reason="training loss rose above its start: mean %.5g over "
                           "steps %d-%d > %.4f at step 1"
                           % (sum(curve[-window:]) / window, step - window + 1, step, curve[0]))
                break
            opt.step()
            sched.step()
            step_s.append(time.perf_counter() - t0)
            rec["steps_done"] = step
            _add_metrics(sums, opt.metrics(across_ranks=False))  # (this rank's: no collective)
        rec["tokens"] = rec["steps_done"] * cfg["batch_tokens"]
        if rec["steps_done"]:  # (every rank is here: a divergence is agreed)
            rec["optimizer_metrics"] = _metrics_record(opt.metrics(), sums, rec["steps_done"])
        if not rec["diverged"]:
            rec["val_loss"] = validate(model, val, ctx, cfg["val_tokens"], rank, world, device)
            if not math.isfinite(rec["val_loss"]) or rec["val_loss"] > curve[0]:
                rec.update(diverged=True, diverged_step=total,
                           diverged_reason="validation loss %r above the first step's training "
                           "loss %.4f" % (rec["val_loss"], curve[0])
                           if math.isfinite(rec["val_loss"]) else
                           "validation loss not finite (%r)" % rec["val_loss"])
                rec["val_loss"] = None
        state = opt.state_bytes()
    except Exception as e:  # an error raised on every rank (rfsdp's step gate agrees them)
        step = rec["steps_done"] + 1
        msg = "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "")
        if phase == "build":  # not the optimizer's doing: the run failed
            rec["error"] = "building the run: " + msg
        else:
            rec.update(diverged=True, diverged_step=step,
                       diverged_reason="%s at step %d" % (msg, step))
        rec["tokens"] = rec["steps_done"] * cfg["batch_tokens"]
        try:
            state = opt.state_bytes() if opt is not None else 0
        except Exception:
            state = 0
    train_s = sum(step_s)
    rec["first_loss"] = curve[0] if curve else None
    tail = curve[-window:]
    rec["train_loss"] = sum(tail) / len(tail) if tail and not rec["diverged"] else None
    rec["train_seconds"] = train_s
    rec["tokens_per_s"] = (len(step_s) * cfg["batch_tokens"] / train_s) if train_s > 0 else None
    rec["step_ms"] = 1e3 * train_s / len(step_s) if step_s else None
    rec["step_ms_median"] = 1e3 * statistics.median(step_s) if step_s else None
    rec["run_seconds"] = time.time() - t_start
    rec["loadavg_end"] = list(os.getloadavg())  # (what else ran: timings mean little under load)
    per_rank = _all_gather_floats([state, _peak_mib(device)], device)
    rec["state_bytes_per_rank"] = [int(r[0]) for r in per_rank]
    rec["peak_mib_per_rank"] = [round(r[1], 1) for r in per_rank]
    rec["curve"] = [round(v, 5) for v in curve]
    rec["lr_end_factor"] = C.lr_factor(cfg["schedule"], total - 1, total)
    del model, opt
    gc.collect()
    return rec


def _add_metrics(sums, m):
    """Adds one step's metrics (this rank's, opt.metrics(across_ranks=False)) to sums."""
    sums["bytes_sent"] = sums.get("bytes_sent", 0) + m["bytes_sent"]
    sums["seconds"] = sums.get("seconds", 0.0) + m["seconds"]
    for k in ("matrices_orthogonalised", "tiles_preconditioned", "roots_refreshed"):
        sums[k] = sums.get(k, 0) + sum(g[k] for g in m["groups"])


def _metrics_record(last, sums, steps):
    """The run's optimizer metrics: the last step's over the ranks (opt.metrics())
    and this rank's per-step means over the run."""
    return dict(last_step=last, per_step_mean_rank0={k: v / steps for k, v in sums.items()})


def describe_metrics(m):
    """One line of a run's optimizer metrics (its last step's), for the log."""
    last = m["last_step"]
    g = last["groups"]
    rms = [x["update_rms"] for x in g if x["update_rms"] is not None]
    parts = ["%d matrices" % sum(x["matrices_orthogonalised"] for x in g)]
    tiles = sum(x["tiles_preconditioned"] for x in g)
    if tiles:
        parts.append("%d tiles (%d roots)" % (tiles, sum(x["roots_refreshed"] for x in g)))
    parts.append("update rms %s" % "/".join("%.3g" % r for r in rms))
    parts.append("%.1f kB sent" % (last["bytes_sent_total"] / 1e3))
    parts.append("optimizer step %.1f ms" % (1e3 * last["seconds_max"]))
    return "last step: " + ", ".join(parts)


def _fmt_time(s):
    s = int(round(s))
    return "%dh%02dm%02ds" % (s // 3600, s % 3600 // 60, s % 60) if s >= 3600 else \
        "%dm%02ds" % (s // 60, s % 60)


def describe(run):
    hp = " ".join("%s=%s" % (k, v) for k, v in run["point"].items())
    return "%s [%s] %s budget %d seed %d" % ("/".join(run["names"]), run["optimizer"], hp,
                                             run["budget"], run["seed"])


def write_json(path, obj):
    tmp = "%s.tmp.%s.%d" % (path, socket.gethostname(), os.getpid())
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def main():
    todo_path, out = sys.argv[1], sys.argv[2]
    with open(todo_path) as f:
        todo = json.load(f)
    cfg = todo["config"]
    device = torch.device("cpu")
    if cfg["device"] == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    torch.set_num_threads(cfg["threads_per_rank"])
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=timedelta(seconds=todo.get("timeout_s", 600)))
    rank, world = dist.get_rank(), dist.get_world_size()
    train, val = split_text(load_text(cfg["data"]))
    runs_dir = os.path.join(out, "runs")
    machine = dict(host=socket.gethostname(), cpu=cpu_name(), device=str(device.type),
                   gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                   torch=torch.__version__, rfsdp=rfsdp.__version__, ranks=world)
    t0 = time.time() - todo.get("elapsed_before", 0.0)
    tokens_done = float(todo.get("tokens_before", 0))
    left_tokens = sum(r["budget"] for r in todo["runs"])
    for i, run in enumerate(todo["runs"]):
        path = os.path.join(runs_dir, run["file"])
        # Another machine sharing the folder may have trained it meanwhile: agree.
        have = torch.tensor([1.0 if (rank == 0 and os.path.exists(path)) else 0.0],
                            device=device)
        dist.all_reduce(have)
        number = todo["offset"] + i + 1
        if have.item() > 0:
            left_tokens -= run["budget"]
            if rank == 0:
                print("[compare] run %d of %d: %s: already in %s, skipped"
                      % (number, todo["total"], describe(run), runs_dir), flush=True)
            continue
        rec = train_run(cfg, run, train, val, rank, world, device)
        rec["machine"] = machine
        rec["config"] = {k: cfg[k] for k in C.TRAINING_KEYS}
        rec["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        tokens_done += run["budget"]
        left_tokens -= run["budget"]
        if rank == 0:
            write_json(path, rec)
            elapsed = time.time() - t0
            left = elapsed / max(tokens_done, 1) * left_tokens
            if rec.get("error"):
                what = "FAILED (%s)" % rec["error"]
            elif rec["diverged"]:
                what = "DIVERGED at step %d (%s)" % (rec["diverged_step"], rec["diverged_reason"])
            else:
                what = "val %.4f, train %.4f, %.0f tokens/s" % (rec["val_loss"], rec["train_loss"],
                                                                 rec["tokens_per_s"])
            if rec.get("optimizer_metrics"):
                what += " | " + describe_metrics(rec["optimizer_metrics"])
            print("[compare] run %d of %d: %s: %s, %.1f s | elapsed %s, about %s left"
                  % (number, todo["total"], describe(run), what, rec["run_seconds"],
                     _fmt_time(elapsed), _fmt_time(left)), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
