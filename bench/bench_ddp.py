"""rfsdp (fully_shard + rfsdp.optim.AdamW) against torch's DistributedDataParallel
(+ torch.optim.AdamW) on the main job's GPT, 2 ranks over Gloo, side by side.

    /usr/bin/python3 bench/bench_ddp.py [--dims 128,256] [--steps 20]

Runs each (variant, width) as its own torchrun job, so each peak RSS is its own,
and prints one table: median step time (forward + backward + step; ratio to
DDP), per-rank parameter + gradient + optimizer-state bytes (counted from the
tensors; for rfsdp also the most gathered-unit bytes live at once), and peak RSS
per rank. Memory is per rank; time is the median over steps after warm-up."""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")


def tensor_bytes(ts):
    return sum(t.numel() * t.element_size() for t in ts)


def worker(args):
    import torch
    import torch.distributed as dist
    from torch import nn
    sys.path.insert(0, os.path.join(ROOT, "python"))
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import rfsdp
    from train_gpt import GPT, batches, load_text

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(args.dim, args.layers, args.heads, args.ctx)
    n_params = sum(p.numel() for p in model.parameters())
    gathered_peak = [0]
    if args.variant == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        for b in model.blocks:
            rfsdp.fully_shard(b)
        rfsdp.fully_shard(model)
        opt = rfsdp.optim.AdamW(model.parameters(), lr=1e-3)
        units = rfsdp.fsdp.units(model)

        def sample(*_):  # gathered parameter and gradient buffers live now
            gathered_peak[0] = max(gathered_peak[0], sum(u.unit.gathered_bytes() for u in units))

        for m in model.modules():
            if getattr(m, "_rfsdp_unit", None):
                m.register_forward_pre_hook(sample)
                m.register_forward_hook(lambda m, a, out: out.register_hook(sample) and None)
    text = load_text()
    data = batches(text, args.batch, args.ctx, torch.Generator().manual_seed(rank))
    times = []
    for _ in range(args.warmup + args.steps):
        x, y = next(data)
        dist.barrier()
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x).view(-1, 256), y.view(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    mem = tensor_bytes(model.parameters()) + tensor_bytes(grads) + tensor_bytes(state)
    if args.variant == "ddp":  # DDP's gradient buckets hold another copy of the gradients
        mem += tensor_bytes(grads)
    out = dict(variant=args.variant, dim=args.dim, params=n_params,
               step_ms=statistics.median(times[args.warmup:]) * 1e3, mem=mem,
               gathered=gathered_peak[0],
               rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    rows = [None] * world
    dist.all_gather_object(rows, out)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    # Torch 1.13's DDP can deadlock in process-group teardown (the Gloo worker
    # thread waits for the GIL while the main thread joins it): leave directly.
    sys.stdout.flush()
    os._exit(0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="128,256", help="model widths, comma-separated")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--variant", choices=["ddp", "rfsdp"], help=argparse.SUPPRESS)
    ap.add_argument("--dim", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        return worker(args)
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for dim in (int(s) for s in args.dims.split(",")):
            for variant in ("ddp", "rfsdp"):
                out = os.path.join(d, "%s_%d.json" % (variant, dim))
                cmd = ["/usr/bin/torchrun", "--standalone", "--nproc_per_node", str(args.nproc),
                       "--redirects", "1", "--tee", "1", os.path.abspath(__file__),
                       "--variant", variant, "--dim", str(dim), "--out", out]
                for k in ("layers", "heads", "ctx", "batch", "steps", "warmup"):
                    cmd += ["--" + k, str(getattr(args, k))]
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                with open(out) as f:
                    results[variant, dim] = json.load(f)
    print("%d ranks (Gloo, 1 thread each), %d layers, batch %d x %d tokens per rank, median of %d steps"
          % (args.nproc, args.layers, args.batch, args.ctx, args.steps))
    print("%-6s %7s %6s %9s %8s %14s %9s %14s %10s" % (
        "width", "params", "", "step ms", "vs DDP", "p+g+state MiB", "vs DDP", "+gathered MiB",
        "peak RSS"))
    for dim in (int(s) for s in args.dims.split(",")):
        ddp = results["ddp", dim]
        for variant in ("ddp", "rfsdp"):
            rows = results[variant, dim]
            ms = max(r["step_ms"] for r in rows)  # the slowest rank sets the pace
            mem = max(r["mem"] for r in rows)
            gathered = max(r["mem"] + r["gathered"] for r in rows)
            print("%-6d %6.2fM %6s %9.1f %7.2fx %14.2f %8.0f%% %14.2f %9.0fM" % (
                dim, rows[0]["params"] / 1e6, variant, ms, ms / max(r["step_ms"] for r in ddp),
                mem / 2 ** 20, 100 * mem / max(r["mem"] for r in ddp), gathered / 2 ** 20,
                max(r["rss_mib"] for r in rows)))


if __name__ == "__main__":
    main()
