"""The C++ example against the Python path: runs examples/cpp's train_mlp (built
against the installed package) on 2 ranks with torchrun, and trains the same
model on the same data in one process with rfsdp's Python optimizers on plain,
unsharded parameters, taking each half batch's gradient as the ranks do and
averaging the two. Every logged loss must agree to float rounding (8-bit states
turn any last-bit difference into a whole code step, so "close" would hide
nothing: they are the same float operations, and agree to 1e-6). Each optimizer
runs twice: sharded over both ranks, and as HSDP with shard groups of one rank
(two replicas: the gradient all-reduced across them). And once with the weights
gathered as int8 codes and bf16 gradients (--comm int8 --grad-comm bf16): within
5 % of the same run, learning alike.

    python check_example.py BINARY [--steps 40]"""
import argparse
import math
import re
import subprocess
import sys

import torch
from torch import nn

import rfsdp

IN, HIDDEN, OUT, BATCH, SEED = 32, 256, 16, 64, 0


def reference(optimizer, steps):
    torch.manual_seed(SEED)  # the draws in the C++ example's order
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))
    teacher = torch.randn(IN, OUT) * (1.0 / math.sqrt(IN))
    xs = torch.randn(steps, BATCH, IN)
    ys = torch.sin(torch.matmul(xs, teacher))
    params = list(model.parameters())
    if optimizer == "adamw8bit":
        opts = [rfsdp.optim.AdamW8bit(params, lr=3e-3, weight_decay=0.0, block=256,
                                      min_8bit_size=4096)]
    else:
        opts = [rfsdp.optim.Muon([dict(params=[p for p in params if p.dim() == 2]),
                                  dict(params=[p for p in params if p.dim() < 2], use_muon=False,
                                       lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)],
                                 lr=0.02, momentum=0.95, nesterov=True, ns_steps=5)]
    losses, half = [], BATCH // 2
    for step in range(steps):
        grads, total = [], 0.0
        for r in range(2):  # rank r's half of the batch
            model.zero_grad()
            loss = nn.functional.mse_loss(model(xs[step, r * half:(r + 1) * half]),
                                          ys[step, r * half:(r + 1) * half])
            loss.backward()
            grads.append([p.grad.clone() for p in params])
            total = total + loss.detach()
        for p, g0, g1 in zip(params, *grads):
            p.grad = (g0 + g1) / 2  # the reduce-scatter's average
        for o in opts:
            o.step()
        losses.append((total / 2).item())
    return losses


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    bad = 0
    for optimizer, shard_size, comm in (("adamw8bit", 0, ()), ("muon", 0, ()), ("adamw8bit", 1, ()),
                                        ("muon", 1, ()),
                                        ("adamw8bit", 0, ("--comm", "int8", "--grad-comm", "bf16"))):
        out = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             "--no-python", args.binary, "--optimizer", optimizer, "--steps", str(args.steps),
             "--log-every", "1", "--shard-size", str(shard_size), *comm],
            capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            print(out.stdout, out.stderr)
            raise SystemExit("train_mlp failed with %d" % out.returncode)
        got = [float(m.group(1)) for m in re.finditer(r"^step +\d+ loss (\S+)$", out.stdout, re.M)]
        want = reference(optimizer, args.steps)
        assert len(got) == args.steps, "expected %d losses, got %d:\n%s" % (args.steps, len(got),
                                                                            out.stdout)
        worst = max(abs(g - w) / max(abs(w), 1e-12) for g, w in zip(got, want))
        print("%-9s C++ (2 ranks, %s) vs Python (1 process): %d losses, %.6f -> %.6f, largest "
              "relative difference %.2e" % (optimizer, " ".join(comm) or ("HSDP 2 x 1" if shard_size
                                                                          else "FSDP"),
                                            len(got), want[0], want[-1], worst))
        # int8 weight codes and bf16 gradients: the same run to a few percent, learning alike
        if comm and (worst > 0.05 or not got[-1] < 0.7 * got[0]):
            bad += 1
            print("  FAIL: the quantised collectives changed the run by more than 5 %")
        elif not comm and (worst > 1e-6 or not want[-1] < 0.7 * want[0]):
            bad += 1
            print("  FAIL: losses differ, or the Python run did not learn")
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
