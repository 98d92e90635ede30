"""Optimizer step time and bytes sent per step on a tensor-parallel block (torch's
ColwiseParallel / RowwiseParallel over tp, then torch FSDP2 over dp: tests'
tp_model.py), 4 process ranks (Gloo), mesh (dp=2, tp=2): torch AdamW beside
rfsdp's AdamW and Muon (Muon on the four matrices, each whole on a root:
ColwiseParallel's rows and RowwiseParallel's column parts; norms and biases
AdamW; and with the fused QKV split per head, q, k, v, which ColwiseParallel
keeps on one tp rank: those blocks cross dp only), and rfsdp's AdamW8bit, Shampoo
and SOAP on every parameter (RowwiseParallel's column parts as global blocks and
tiles: blocks of 64, max_preconditioner_dim 128, dividing the part widths). Bytes: what the optimizer's Comm sent per step, summed over the ranks
and the most of one rank (torch AdamW sends none: element-wise on the local
pieces, no check across ranks).
--mesh 3d: the same block over HSDP x TP, mesh (dp_replicate=2, dp_shard=2, tp=2),
8 process ranks (torch FSDP2 over (dp_replicate, dp_shard)).
--shard rfsdp: rfsdp.fully_shard over the data-parallel dims in place of FSDP2 (its
plan of each tp piece, by the policy each optimizer asks for: the per-head case
rfsdp.policy.muon's split, which keeps each head's q, k, v whole on one dp rank,
nothing to send; Shampoo and SOAP whole tiles, AdamW8bit whole blocks).

    python bench/tp_optimizers.py [--dim 256 --heads 4 --ffn 1024 --steps 20] [--mesh 2d|3d]
                                  [--shard fsdp2|rfsdp] [--whole-step]"""
import argparse
import os
import statistics
import sys
import time

import torch

import rfsdp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
import tp_model as tm  # noqa: E402
from ranks import run_ranks  # noqa: E402


MESHES = {"2d": (4, "dp=2, tp=2"), "3d": (8, "dp_replicate=2, dp_shard=2, tp=2")}


def worker(rank, world, args):
    mesh, dp = (tm.mesh_2d(), "dp") if args.mesh == "2d" else (tm.mesh_3d(), tm.DP_3D)
    out = {}
    for name in ("torch AdamW", "rfsdp AdamW", "rfsdp Muon + AdamW", "Muon, qkv per head",
                 "rfsdp AdamW8bit", "rfsdp Shampoo", "rfsdp SOAP"):
        torch.manual_seed(0)
        heads = name.endswith("per head")  # (qkv's q, k, v of each head: blocks of its own)
        head_blocks = [args.dim // args.heads] * 3 * args.heads
        if args.shard == "fsdp2":
            model = tm.tensor_parallel(tm.Block(args.dim, args.heads, args.ffn), mesh, dp=dp)
        else:
            model = tm.tensor_parallel(tm.Block(args.dim, args.heads, args.ffn), mesh, dp=None)
            policy = rfsdp.policy.muon(split={"qkv.weight": head_blocks}) if heads else \
                rfsdp.policy.blockwise_8bit(64) if name.endswith("AdamW8bit") else \
                rfsdp.policy.shampoo(128) if name.endswith(("Shampoo", "SOAP")) else None
            rfsdp.fully_shard(model, mesh=mesh[dp], policy=policy)
        if name == "torch AdamW":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        elif name == "rfsdp AdamW":
            opt = rfsdp.optim.AdamW(model.parameters(), lr=1e-3)
        elif name == "rfsdp AdamW8bit":
            opt = rfsdp.optim.AdamW8bit(model.parameters(), lr=1e-3, block=64)
        elif name == "rfsdp Shampoo":
            opt = rfsdp.optim.Shampoo(model.parameters(), lr=1e-3, max_preconditioner_dim=128,
                                      precondition_frequency=10, start_preconditioning_step=10)
        elif name == "rfsdp SOAP":
            opt = rfsdp.optim.SOAP(model.parameters(), lr=1e-3, max_preconditioner_dim=128,
                                   precondition_frequency=10)
        else:
            named = list(model.named_parameters())
            mats = [p for n, p in named if n in tm.MATRICES and not (heads and n == "qkv.weight")]
            rest = [p for n, p in named if n not in tm.MATRICES]
            groups = [dict(params=mats), dict(params=rest, use_muon=False)]
            if heads:
                # (rfsdp.fully_shard's shard carries the plan's blocks: Muon takes them)
                groups.append(dict(params=[model.qkv.weight], split_sizes=head_blocks
                                   if args.shard == "fsdp2" else None))
            opt = rfsdp.optim.Muon(groups, lr=0.02)
        x = torch.randn(2, 16, args.dim)
        model(x).pow(2).mean().backward()
        opt.step()  # (warm-up: layouts, states)
        comm = getattr(opt, "comm", None)
        if comm is not None:
            comm.reset_stats()
        times = []
        for _ in range(args.steps):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            if args.whole_step:  # (forward, backward and the sharding's collectives too)
                opt.zero_grad()
                model(x).pow(2).mean().backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        sent = comm.stats()["bytes_sent"] / args.steps if comm is not None else 0
        out[name] = (statistics.median(times), sent)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--mesh", choices=sorted(MESHES), default="2d")
    ap.add_argument("--shard", choices=("fsdp2", "rfsdp"), default="fsdp2")
    ap.add_argument("--whole-step", action="store_true",
                    help="time forward + backward + step (bytes: the optimizer's alone)")
    args = ap.parse_args()
    world, shape = MESHES[args.mesh]
    got = run_ranks(worker, world, args)
    print("block dim %d heads %d ffn %d, %d ranks (%s), %s over dp, Gloo, median of %d %s"
          % (args.dim, args.heads, args.ffn, world, shape,
             "torch FSDP2" if args.shard == "fsdp2" else "rfsdp.fully_shard", args.steps,
             "forward + backward + steps" if args.whole_step else "optimizer steps"))
    for name in got[0]:
        t = max(g[name][0] for g in got)
        sent = [g[name][1] for g in got]
        print("%-20s step %8.2f ms (slowest rank)  sent %10.0f B/step (all ranks), %10.0f (most)"
              % (name, t * 1e3, sum(sent), max(sent)))


if __name__ == "__main__":
    main()
