"""What Hyperball's and NorMuon's norms cost on ragged shards: the optimizer step
time of Muon, MuonH (hyperball=True), NorMuon, NorMuonH and AdamW / AdamH on 2
process ranks (Gloo, CPU), for a stack of matrices planned ragged
(rfsdp.policy.muon(): boundaries cut matrices, whose norms need the one float64
all-reduce) and planned whole (policy.muon(whole=True): every matrix on one
rank, no all-reduce), with the bytes each rank sent in that all-reduce.

    python bench/hyperball_cost.py [--dim 512] [--layers 4] [--steps 12]

Prints one line per (plan, optimizer): the median and the least step time (ms,
optimizer step only, gradients set by hand; each the slowest rank's), and the
extra all-reduce's bytes per rank; then that all-reduce alone (4 float64)."""
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

KINDS = ["muon", "muon:hyperball", "normuon", "normuon:hyperball", "adamw", "adamw:hyperball"]


def model_of(dim, layers):
    torch.manual_seed(0)
    # every matrix a different row count, so a ragged plan cuts some of them
    return nn.ParameterList([nn.Parameter(torch.randn(dim + 16 * i, dim) / dim ** 0.5)
                             for i in range(2 * layers)])


def optimizer(kind, params):
    base, _, variant = kind.partition(":")
    ball = variant == "hyperball"
    wd = 0.0 if ball else 0.01
    if base == "adamw":
        return rfsdp.optim.AdamW(params, lr=1e-3, weight_decay=wd, hyperball=ball)
    cls = rfsdp.optim.NorMuon if base == "normuon" else rfsdp.optim.Muon
    return cls(params, lr=0.02, weight_decay=wd, hyperball=ball)


def worker(rank, world, folder, args, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(folder, "init"),
                            rank=rank, world_size=world)
    rows = []
    for plan in ("whole", "cut"):
        for kind in KINDS:
            model = model_of(args.dim, args.layers)
            rfsdp.fully_shard(model, policy=rfsdp.policy.muon(whole=plan == "whole"))
            params = list(model.parameters())
            opt = optimizer(kind, params)
            g = torch.Generator().manual_seed(rank)
            times = []
            for _ in range(args.steps):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=g)
                dist.barrier()
                t0 = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t0)
            sent = opt.hyperball_bytes() if kind.startswith("adamw") else opt.normalise_bytes()
            t = torch.tensor([statistics.median(times[2:]), min(times[2:]), float(sent)],
                             dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            rows.append((plan, kind, t[0].item() * 1e3, t[1].item() * 1e3, int(t[2].item())))
    # The extra all-reduce alone: 4 float64 (one cut parameter's sums), as the step runs it.
    t4 = torch.zeros(4, dtype=torch.float64)
    ar = []
    for _ in range(200):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t4)
        ar.append(time.perf_counter() - t0)
    rows.append(("-", "all_reduce(4 x f64)", statistics.median(ar) * 1e3, min(ar) * 1e3, 32))
    if rank == 0:
        torch.save(rows, out)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rows.pt")
        mp.spawn(worker, args=(2, folder, args, out), nprocs=2)
        rows = torch.load(out)
    last = args.dim + 16 * (2 * args.layers - 1)
    print("2 ranks (Gloo, CPU, 1 thread each), %d matrices of %d..%d x %d; times: the slowest "
          "rank's" % (2 * args.layers, args.dim, last, args.dim))
    print("%-6s %-20s %10s %10s %16s" % ("plan", "optimizer", "median ms", "min ms",
                                         "norm bytes/rank"))
    for plan, kind, ms, least, sent in rows:
        print("%-6s %-20s %10.2f %10.2f %16d" % (plan, kind, ms, least, sent))


if __name__ == "__main__":
    sys.exit(main())
