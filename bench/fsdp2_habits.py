"""What two FSDP2 habits cost on rfsdp, side by side in one run (2 ranks, Gloo, CPU):

1. Gradient accumulation, 4 micro-batches per optimizer step: gradient sync every
   micro-batch vs only the last (set_requires_gradient_sync(False) before the
   others; and with set_reshard_after_backward(False) too): bytes sent per step,
   peak bytes of gathered buffers (parameters + gradients, sampled at every
   gradient), median step time.
2. Clipping: torch.nn.utils.clip_grad_norm_ over the shards (ShardGrad: global
   norm, one all-reduce) vs rfsdp.clip_grad_norm_ (C++, one all-reduce) vs torch's
   function on plain tensors of the same local gradients (each rank's own norm:
   wrong, the floor of the local work); and a torch AdamW step with ShardGrad
   gradients vs plain ones (what the type costs an optimizer) vs FSDP2's DTensors.

  python bench/fsdp2_habits.py [--dim 512] [--depth 8] [--steps 10]"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import rfsdp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
from models import Net  # noqa: E402

WORLD = 2
MICRO = 4


def sharded(args):
    torch.manual_seed(0)
    model = Net(d=args.dim, depth=args.depth)
    for b in model.blocks:
        rfsdp.fully_shard(b)
    rfsdp.fully_shard(model)
    return model


def accumulation(args, rank, mode):
    model = sharded(args)
    units = rfsdp.fsdp.units(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    peak = [0]

    def sample(_):
        peak[0] = max(peak[0], sum(u.unit.gathered_bytes() for u in units))
    for p in [fp for u in units for fp in u.full if fp.requires_grad]:
        p.register_post_accumulate_grad_hook(sample)
    g = torch.Generator().manual_seed(1 + rank)
    times, sent = [], []
    for step in range(args.steps + 1):
        x, y = torch.randn(MICRO, 32, 7, generator=g), torch.randn(MICRO, 32, 5, generator=g)
        before = sum(u.comm.stats()["bytes_sent"] for u in units)
        t0 = time.perf_counter()
        for i in range(MICRO):
            last = i == MICRO - 1
            if mode != "every":
                model.set_requires_gradient_sync(last)
                model.set_reshard_after_backward(last or mode != "last, kept gathered")
            nn.functional.mse_loss(model(x[i]), y[i]).div(MICRO).backward()
        opt.step()
        opt.zero_grad()
        if step:  # the first step records the prefetch order
            times.append(time.perf_counter() - t0)
            sent.append(sum(u.comm.stats()["bytes_sent"] for u in units) - before)
    return statistics.median(times), statistics.median(sent), peak[0]


def clipping(args, rank):
    model = sharded(args)
    x, y = torch.randn(32, 7), torch.randn(32, 5)
    nn.functional.mse_loss(model(x), y).backward()
    params = list(model.parameters())
    plain_params = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = p.grad.as_subclass(torch.Tensor).clone()
        plain_params.append(q)
    ways = {
        "torch clip_grad_norm_ on ShardGrad (global)":
            lambda: torch.nn.utils.clip_grad_norm_(params, 1e9),
        "rfsdp.clip_grad_norm_ (C++, global)": lambda: rfsdp.clip_grad_norm_(model, 1e9),
        "torch clip on plain local grads (per-rank: wrong)":
            lambda: torch.nn.utils.clip_grad_norm_(plain_params, 1e9),
    }
    out = {}
    for name, fn in ways.items():
        ts = []
        for _ in range(args.steps * 5):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        out[name] = statistics.median(ts)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
    torch.manual_seed(0)
    theirs = Net(d=args.dim, depth=args.depth)
    mesh = init_device_mesh("cpu", (WORLD,))
    for b in theirs.blocks:
        fsdp2_fully_shard(b, mesh=mesh)
    fsdp2_fully_shard(theirs, mesh=mesh)
    nn.functional.mse_loss(theirs(x), y).backward()
    for name, ps in (("AdamW step, ShardGrad grads", params), ("AdamW step, plain grads", plain_params),
                     ("AdamW step, FSDP2 (DTensor params and grads)", list(theirs.parameters()))):
        opt = torch.optim.AdamW(ps, lr=1e-6)
        ts = []
        for _ in range(args.steps * 5):
            t0 = time.perf_counter()
            opt.step()
            ts.append(time.perf_counter() - t0)
        out[name] = statistics.median(ts)
    return out


def worker(rank, args, init_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=WORLD)
    rows = [(mode,) + accumulation(args, rank, mode)
            for mode in ("every", "last", "last, kept gathered")]
    clip = clipping(args, rank)
    n = rfsdp.global_numel(sharded(args))  # fully_shard is collective
    if rank == 0:
        print("model: Net(d=%d, depth=%d), %d parameters; %d micro-batches per step; 2 ranks"
              % (args.dim, args.depth, n, MICRO))
        print("%-28s %12s %14s %18s %8s" % ("gradient sync", "step (ms)", "sent (MB)",
                                            "peak gathered (MB)", "time x"))
        base = rows[0][1]
        for mode, t, sent, peak in rows:
            print("%-28s %12.2f %14.2f %18.2f %8.2f" % (mode, t * 1e3, sent / 1e6, peak / 1e6,
                                                        t / base))
        print()
        print("%-52s %12s %8s" % ("clipping / optimizer", "median (us)", "ratio"))
        ref = clip["torch clip on plain local grads (per-rank: wrong)"]
        for name, t in clip.items():
            r = t / (ref if "clip" in name else clip["AdamW step, plain grads"])
            print("%-52s %12.1f %8.2f" % (name, t * 1e6, r))
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(args, os.path.join(d, "init")), nprocs=WORLD)


if __name__ == "__main__":
    main()
