"""The main job: a small GPT trained on real English text (Debian's fortunes,
byte-level tokens), fully sharded with rfsdp over torch.distributed (Gloo on
CPUs, NCCL on GPUs), comparing optimizers on the same data and seed.

    torchrun --standalone --nproc_per_node 2 examples/train_gpt.py --compare
    torchrun --standalone --nproc_per_node 8 examples/train_gpt.py --compare --device cuda

Prints a progress line while training and, at the end, a table (final train and
validation loss, tokens/s, peak memory and optimizer-state bytes per rank) and a
PNG of the loss curves against steps and against wall-clock seconds, with the
validation losses as points."""
import argparse
import math
import os
import resource
import time

import torch
import torch.distributed as dist
from torch import nn

import rfsdp

# The model, the data and the optimizers (names, ":variant" low-bit states, the
# settings of each, the policy each needs) live in the package, shared with
# rfsdp.compare (python -m rfsdp.compare: sweeps per optimizer and budget).
from rfsdp.compare.gpt import FORTUNES, GPT, Block, batches as _batches, load_text  # noqa: F401,E402
from rfsdp.compare.optimizers import MUON_LIKE, OPTIMIZERS, VARIANTS, make_optimizer  # noqa: E402

# How the collectives carry the data (--comm, --grad-comm: each run once per choice,
# same data and seed): the weights' all-gather in the compute dtype or as block codes,
# the gradients' reduce in fp32 or in bf16 summed in fp32.
WEIGHT_COMMS = {"full": None, "int8": "int8", "float8": "float8_e4m3fn"}
GRAD_COMMS = {"fp32": None, "bf16": torch.bfloat16}
SHAMPOO_DIM = 256  # max_preconditioner_dim: tiles of at most 256 x 256
DEVICE = torch.device("cpu")  # main() sets it (--device)


def batches(data, batch, ctx, gen):
    return _batches(data, batch, ctx, gen, DEVICE)


def mean_over_ranks(v):
    t = torch.tensor([float(v)], device=DEVICE)  # NCCL takes GPU tensors only
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def comm_policy(comm):
    """The run's rfsdp.CommPolicy from its 'weights/gradients' choice (None: today's)."""
    weights, _, grads = comm.partition("/")
    if WEIGHT_COMMS[weights] is None and GRAD_COMMS[grads] is None:
        return None
    return rfsdp.CommPolicy(weights=WEIGHT_COMMS[weights], weight_block=256,
                            gradients=GRAD_COMMS[grads])


def run(label, args, train, val, rank, world):
    name, _, comm = label.partition("@")
    torch.manual_seed(args.seed)
    model = GPT(args.dim, args.layers, args.heads, args.ctx).to(DEVICE)
    n_params = sum(p.numel() for p in model.parameters())
    # One plan for every optimizer: whole 8-bit blocks and whole Shampoo tiles.
    pol = rfsdp.policy.combine(rfsdp.policy.blockwise_8bit(256), rfsdp.policy.shampoo(SHAMPOO_DIM))
    base, _, variant = name.partition(":")
    # muon:heads: every head of the fused QKV (its q, k and v rows) its own matrix, and
    # a plan that keeps each head whole on one rank (orthogonalised where it lies).
    per_head = [args.dim // args.heads] * (3 * args.heads) if name == "muon:heads" else None
    if per_head:
        pol = rfsdp.policy.combine(pol, rfsdp.policy.muon(
            split=lambda n, p: per_head if n.endswith("qkv.weight") else None))
    cp = comm_policy(comm or "full/fp32")  # (a label without @: today's collectives)
    for b in model.blocks:
        rfsdp.fully_shard(b, policy=pol, comm_policy=cp)
    rfsdp.fully_shard(model, policy=pol, comm_policy=cp)
    units = rfsdp.fsdp.units(model)
    if base in MUON_LIKE:
        # The blocks' matrices take Muon; embeddings, head, norms and biases AdamW.
        # Weight decay per step (lr * wd) equal to the AdamW runs'.
        opt = make_optimizer(name, model, args.muon_lr, weight_decay=0.1 * args.lr / args.muon_lr,
                             adam_lr=args.lr)
    elif base == "shampoo":
        opt = make_optimizer(name, model, args.lr,
                             precondition_frequency=args.precondition_frequency,
                             factor_dtype=getattr(torch, args.factor_dtype))
    else:  # AdamW, AdamW8bit, SOAP: lr and weight decay 0.1 (rfsdp.compare.optimizers.DEFAULTS)
        opt = make_optimizer(name, model, args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own batches
    data = batches(train, args.batch, args.ctx, gen)
    curve, seconds, val_points, first = [], [], [], 1
    root = os.path.join(args.checkpoint_dir, label.replace("/", "-")) if args.checkpoint_dir else None
    if root and args.resume and rfsdp.checkpoint.latest(root):
        path = rfsdp.checkpoint.latest(root)
        c0 = time.time()
        extra = rfsdp.checkpoint.load(path, model, opt)
        sched.load_state_dict(extra["sched"])
        curve, seconds, val_points = extra["curve"], extra["seconds"], extra["val_points"]
        first = extra["step"] + 1
        for _ in range(extra["step"]):  # the data stream where it stopped
            next(data)
        if rank == 0:
            print("%-9s resumed from %s (step %d) in %.2f s" % (name, path, extra["step"],
                                                                  time.time() - c0), flush=True)

    def validate():  # the same validation batches every time
        with torch.no_grad():
            vgen = torch.Generator().manual_seed(12345 + rank)
            vdata = batches(val, args.batch, args.ctx, vgen)
            vl = sum(nn.functional.cross_entropy(model(x).view(-1, 256), y.view(-1)).item()
                     for x, y in (next(vdata) for _ in range(args.val_batches))) / args.val_batches
        return mean_over_ranks(vl)

    tokens = (first - 1) * args.batch * args.ctx * world
    sent = 0  # bytes this rank's gathers and reduces sent in training steps
    t0 = time.time() - (seconds[-1] if seconds else 0.0)
    paused = 0.0  # validation and checkpoint time, left out of the clock
    for step in range(first, args.steps + 1):
        if step == args.crash_at_step and rank == world - 1 \
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os._exit(3)  # a crash (tests: torchrun restarts the job, which resumes)
        x, y = next(data)
        for u in units:  # (what validation and checkpoints gathered is not the step's)
            u.unit.reset_bytes_sent()
        loss = nn.functional.cross_entropy(model(x).view(-1, 256), y.view(-1))
        opt.zero_grad()
        loss.backward()
        rfsdp.clip_grad_norm_(model, 1.0)
        opt.step()
        sched.step()
        tokens += x.numel() * world
        sent += sum(u.unit.bytes_sent() for u in units)
        curve.append(mean_over_ranks(loss.item()))
        seconds.append(time.time() - t0 - paused)
        if step % args.val_every == 0 and step != args.steps:
            v0 = time.time()
            val_points.append((step, seconds[-1], validate()))
            paused += time.time() - v0
        if root and step % args.save_every == 0 and step != args.steps:
            c0 = time.time()
            path = rfsdp.checkpoint.save_step(
                root, step, model, opt, keep_last=2,
                extra=dict(step=step, sched=sched.state_dict(), curve=curve, seconds=seconds,
                           val_points=val_points))
            paused += time.time() - c0
            if rank == 0:
                size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
                print("%-9s saved %s: %.2f MiB in %.2f s" % (name, path, size / 2 ** 20,
                                                             time.time() - c0), flush=True)
        if rank == 0 and (step % args.log_every == 0 or step == 1):
            print("%-9s step %4d  loss %.4f  tokens/s %.0f" % (label, step, curve[-1],
                                                               tokens / (time.time() - t0)), flush=True)
    elapsed = time.time() - t0 - paused
    vl = validate()
    val_points.append((args.steps, seconds[-1], vl))
    state = opt.state_bytes()
    if args.save_final:
        full = rfsdp.full_parameters(model)
        if rank == 0:
            torch.save(full, "%s.%s.pt" % (args.save_final, name))
    if args.final_checkpoint:
        rfsdp.checkpoint.save(os.path.join(args.final_checkpoint, name), model, opt)
    note = ""
    if base in MUON_LIKE:  # how the roots balance Newton–Schulz, and what a step moves
        moved = torch.tensor([float(opt._impl.gather_send_elems())], device=DEVICE)
        dist.all_reduce(moved, op=dist.ReduceOp.MAX)
        mats = opt._impl.matrices()
        note = ("%d matrices, %.1f GFLOP of Newton-Schulz a step (all ranks), max/mean per rank "
                "%.3f; gather moves at most %.2f MiB per rank per step (and the scatter as much back)"
                % (len(mats), sum(m["flops"] for m in mats) / 1e9, opt._impl.flop_imbalance(),
                   moved.item() * 4 / 2 ** 20))
    if base == "shampoo":
        note = ("%d tiles, %.2f MiB of factors and roots per rank, %.1f s in roots (of %.1f s), "
                "%d roots retried in fp64" % (opt._impl.num_tiles(), opt._impl.factor_bytes() / 2 ** 20,
                                              opt._impl.root_seconds(), elapsed,
                                              opt._impl.fp64_retries()))
    if base == "soap":
        note = ("%d tiles, %.2f MiB of moments, factors and bases per rank, %d eigendecompositions "
                "retried in fp64" % (opt._impl.num_tiles(), opt.state_bytes() / 2 ** 20,
                                     opt._impl.fp64_retries()))
    peak_mib = torch.cuda.max_memory_allocated() / 2 ** 20 if DEVICE.type == "cuda" \
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # GPU memory / host RSS
    steps_run = args.steps - first + 1
    return dict(name=label, params=n_params, sent_mib=sent / max(1, steps_run) / 2 ** 20,
                step_ms=1e3 * elapsed / max(1, steps_run), train=sum(curve[-10:]) / len(curve[-10:]),
                val=vl, tps=tokens / elapsed, curve=curve, seconds=seconds, val_points=val_points,
                peak_mib=peak_mib,
                state_bytes=state, note=note)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    ap.add_argument("--compare", action="store_true", help="run every optimizer on the same data and seed")
    ap.add_argument("--optimizers", help="run these (comma-separated) on the same data and seed")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW's (and Muon's aux groups')")
    ap.add_argument("--muon-lr", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--comm", default="full",
                    help="weights' all-gather, comma-separated runs: full (the compute dtype), "
                         "int8, float8 (block codes of 256 elements, rfsdp.CommPolicy)")
    ap.add_argument("--grad-comm", default="fp32",
                    help="gradients' reduce, comma-separated runs: fp32, bf16 (sent in bf16, "
                         "summed in fp32)")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--val-every", type=int, default=50, help="validation points in the plot")
    ap.add_argument("--precondition-frequency", type=int, default=10, help="Shampoo's (and its start)")
    ap.add_argument("--factor-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="dtype of Shampoo's factors and roots")
    ap.add_argument("--plot", default="loss_curves.png")
    ap.add_argument("--checkpoint-dir", help="save <dir>/<optimizer>/step_<n> every --save-every "
                    "steps (the 2 newest kept)")
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--resume", action="store_true",
                    help="continue from the newest checkpoint under --checkpoint-dir, if any")
    ap.add_argument("--save-final", help="write the final full parameters to <this>.<optimizer>.pt")
    ap.add_argument("--final-checkpoint", help="save the final model and optimizer to "
                    "<this>/<optimizer> (an rfsdp checkpoint)")
    ap.add_argument("--text", help="train on this file instead of Debian's fortunes")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: each rank on GPU LOCAL_RANK over NCCL (bf16 compute, fp32 "
                    "reduction: fully_shard's GPU default)")
    ap.add_argument("--crash-at-step", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    global DEVICE
    torch.set_num_threads(1)
    if args.device == "cuda":
        DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(DEVICE)
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    text = load_text(args.text)
    cut = int(0.95 * text.numel())
    train, val = text[:cut], text[cut:]
    if rank == 0:
        print("%s: %.2f MB of text, %d ranks, %d steps x %d x %d tokens per rank"
              % (args.text or "fortunes", text.numel() / 1e6, world, args.steps, args.batch, args.ctx), flush=True)
    names = OPTIMIZERS if args.compare else [args.optimizer]
    if args.optimizers:
        names = args.optimizers.split(",")
        unknown = [n for n in names if n.partition(":")[0] not in OPTIMIZERS
                   or (":" in n and n.partition(":")[2] not in VARIANTS.get(n.partition(":")[0], {}))]
        if unknown:
            ap.error("--optimizers: unknown %s (choose from %s, or these variants: %s)"
                     % (unknown, OPTIMIZERS, ", ".join("%s:%s" % (b, v) for b in VARIANTS
                                                      for v in VARIANTS[b])))
    comms = ["%s/%s" % (w, g) for w in args.comm.split(",") for g in args.grad_comm.split(",")]
    bad = [c for c in comms if c.partition("/")[0] not in WEIGHT_COMMS
           or c.partition("/")[2] not in GRAD_COMMS]
    if bad:
        ap.error("--comm / --grad-comm: unknown %s (weights: %s; gradients: %s)"
                 % (bad, ", ".join(WEIGHT_COMMS), ", ".join(GRAD_COMMS)))
    if comms != ["full/fp32"]:  # each optimizer once per communication choice
        names = ["%s@%s" % (n, c) for n in names for c in comms]
    results = [run(n, args, train, val, rank, world) for n in names]
    if rank == 0:
        width = max([16] + [len(r["name"]) for r in results])
        print("\n%-*s %8s %10s %10s %10s %9s %12s %14s %13s" % (
            width, "optimizer", "params", "train loss", "val loss", "tokens/s", "step ms",
            "peak MiB/rank", "opt state/rank", "sent MiB/step"))
        for r in results:
            print("%-*s %7.2fM %10.4f %10.4f %10.0f %9.1f %12.0f %13.2fM %13.3f" % (
                width, r["name"], r["params"] / 1e6, r["train"], r["val"], r["tps"], r["step_ms"],
                r["peak_mib"], r["state_bytes"] / 2 ** 20, r["sent_mib"]))
        for r in results:
            if r["note"]:
                print("%s: %s" % (r["name"], r["note"]))
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
            for k, r in enumerate(results):
                color = "C%d" % k
                by_step.plot(range(1, len(r["curve"]) + 1), r["curve"], color=color, label=r["name"])
                by_time.plot(r["seconds"], r["curve"], color=color, label=r["name"])
                vs, vt, vl = zip(*r["val_points"])
                by_step.plot(vs, vl, "o", color=color, markersize=5)
                by_time.plot(vt, vl, "o", color=color, markersize=5)
            by_step.set_xlabel("step")
            by_time.set_xlabel("wall-clock seconds (training only)")
            by_step.set_ylabel("loss: train (lines, mean over ranks), validation (points)")
            by_step.legend()
            fig.suptitle("GPT on fortunes, %d ranks" % world)
            fig.tight_layout()
            fig.savefig(args.plot, dpi=100)
            print("loss curves: %s" % os.path.abspath(args.plot))
        except ImportError:
            print("matplotlib missing: no plot (scripts/setup.sh installs it into the environment)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
