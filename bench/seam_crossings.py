"""Python -> C++ crossings (calls into rfsdp._C, objects built there included)
per optimizer step, per fully_shard unit, and per checkpoint load, for each
optimizer: what the seam between rfsdp.optim and the C++ optimizers costs. One
process (a one-rank Gloo group); a model of `units` blocks of `per_unit`
parameters each, two parameter groups (an LR scheduler changes the first
group's lr every step, as a warm-up would).

    python bench/seam_crossings.py [--units 8] [--steps 5]

Prints a table: crossings per step, per unit and per parameter, the
microseconds one step spends in Python and C++ (median), and the crossings of
one rfsdp.checkpoint.load and of one load_state_dict(state_dict()) (the load
alone) after the steps."""
import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

import rfsdp


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def model_of(units, d):
    m = nn.Sequential(*[Block(d) for _ in range(units)])
    for b in m:
        rfsdp.fully_shard(b)
    rfsdp.fully_shard(m)
    return m


def optimizer(name, model):
    params = list(model.parameters())
    mats = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    if name == "muon":
        return rfsdp.optim.Muon([dict(params=mats), dict(params=rest, use_muon=False)], lr=0.02)
    make = dict(adamw=rfsdp.optim.AdamW, adamw8bit=lambda g, **k: rfsdp.optim.AdamW8bit(
        g, min_8bit_size=1, **k), shampoo=rfsdp.optim.Shampoo)[name]
    return make([dict(params=mats), dict(params=rest, weight_decay=0.0)], lr=1e-3)


class Counter:
    """Counts calls into rfsdp._C: its functions, its classes' methods and
    constructors, and their comparisons are wrapped, so every call counts however
    it is made (sys.setprofile would miss calls made with *args)."""

    def __init__(self):
        self.n = 0
        self.names = {}  # calls by name, while on
        self.on = False
        from rfsdp import _C
        for name, obj in list(vars(_C).items()):
            if name.startswith("_"):
                continue
            if isinstance(obj, type):
                for attr, f in list(vars(obj).items()):  # its own methods (a base's once)
                    counted = not attr.startswith("_") or attr in ("__init__", "__eq__", "__ne__")
                    if counted and callable(f) and not isinstance(f, type):
                        setattr(obj, attr, self._wrap(getattr(obj, attr)))
            elif callable(obj):
                setattr(_C, name, self._wrap(obj))

    def counting(self, fn):
        """fn()'s crossings."""
        self.n, self.on = 0, True
        try:
            fn()
        finally:
            self.on = False
        return self.n

    def _wrap(self, f):
        def counted(*args, **kwargs):
            if self.on:
                self.n += 1
                self.names[f.__name__] = self.names.get(f.__name__, 0) + 1
            return f(*args, **kwargs)
        return counted


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--units", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    d = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method="file://" + os.path.join(d, "init"), rank=0,
                            world_size=1)
    torch.manual_seed(0)
    print("rfsdp from %s" % os.path.dirname(rfsdp.__file__))
    counter = Counter()
    print("%-10s %8s %10s %10s %14s %14s %16s %16s" % (
        "optimizer", "params", "per step", "per unit", "per parameter", "step us (med)",
        "checkpoint.load", "load_state_dict"))
    for name in ("adamw", "adamw8bit", "muon", "shampoo"):
        model = model_of(args.units, args.dim)
        opt = optimizer(name, model)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: min(1.0, (s + 1) / 100),
                                                        lambda s: 1.0])
        n_params = sum(1 for _ in model.parameters())
        counts, times = [], []
        x = torch.randn(4, args.dim)
        for k in range(2 * args.steps):  # counted steps, then timed ones (no profiler)
            model(x).square().mean().backward()
            if k < args.steps:
                counts.append(counter.counting(opt.step))
            else:
                t0 = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t0)
            sched.step()
            opt.zero_grad()
        per_step = statistics.median(counts)
        us = statistics.median(times) * 1e6
        path = os.path.join(d, name)
        rfsdp.checkpoint.save(path, model, opt)
        per_load = counter.counting(lambda: rfsdp.checkpoint.load(path, model, opt))
        shutil.rmtree(path)
        sd = opt.state_dict()
        per_sd_load = counter.counting(lambda: opt.load_state_dict(sd))
        print("%-10s %8d %10d %10.1f %14.2f %14.0f %16d %16d" % (
            name, n_params, per_step, per_step / (args.units + 1), per_step / n_params, us,
            per_load, per_sd_load))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
