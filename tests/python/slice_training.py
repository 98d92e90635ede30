"""The loop the multi-rank tests share: every rank trains on its slice of each
batch, so the ranks together see the whole batch the unsharded reference sees;
the reference itself (one process, plain torch, the whole batch) and the one
comparison of a run with it; and, for tests that give gradients, each rank's
rows of a full gradient."""
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn

import rfsdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import run_ranks  # noqa: E402


def save_on_two_resume_on_one(worker, seed):
    """worker(rank, world, seed, ckpt) run on 2 ranks (it saves ckpt part way) and
    then on 1 (it loads ckpt and finishes): rank 0's results, [2 ranks', 1 rank's]."""
    with tempfile.TemporaryDirectory() as d:
        ckpt = os.path.join(d, "ckpt")
        return [run_ranks(worker, world, seed, ckpt)[0] for world in (2, 1)]


def set_grads(model, full):
    """Every parameter's gradient from full[name] (the whole tensor's): this
    rank's rows of it where fully_shard sharded the parameter."""
    for n, p in model.named_parameters():
        info = rfsdp.shard_info(p)
        g = full[n]
        if info is not None:
            g = g.reshape(info.full_rows, -1)[info.row_begin:info.row_end].reshape(p.shape)
        p.grad = g.clone()


def train_on_slices(model, opt, xs, ys, rank, world, loss_of=None, before_step=None,
                    after_step=None):
    """For each (x, y) of xs, ys (batch along dim 1): this rank's 1/world slice;
    the loss (mse_loss(model(x), y), or loss_of(model, x, y)); zero_grad, backward,
    before_step(), opt.step(), after_step(). Returns each step's loss averaged over
    the ranks."""
    per = xs.shape[1] // world
    losses = []
    for x, y in zip(xs, ys):
        xb, yb = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        loss = loss_of(model, xb, yb) if loss_of else nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        if before_step:
            before_step()
        opt.step()
        if after_step:
            after_step()
        t = loss.detach().clone()
        if world > 1:
            dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def train_reference(model, opt, xs, ys, as_ranks=1, loss_of=None, before_step=None):
    """The reference run of train_on_slices: one process, one BLAS thread (as each
    rank), each step on the whole batch. as_ranks > 1: the gradient summed slice by
    slice, each slice's loss divided by as_ranks, the sum that many ranks' average
    makes (each term halved exactly where as_ranks is 2), so a run on that many
    ranks compares bit for bit. Returns each step's loss (the slices' mean)."""
    per = xs.shape[1] // as_ranks
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    losses = []
    try:
        for x, y in zip(xs, ys):
            opt.zero_grad()
            total = 0.0
            for k in range(as_ranks):
                xb, yb = x[k * per:(k + 1) * per], y[k * per:(k + 1) * per]
                loss = loss_of(model, xb, yb) if loss_of else nn.functional.mse_loss(model(xb), yb)
                (loss / as_ranks).backward()
                total += loss.item()
            if before_step:
                before_step()
            opt.step()
            losses.append(total / as_ranks)
    finally:
        torch.set_num_threads(threads)
    return losses


def assert_trains_like(reference, got, rtol=0, atol=0, what=""):
    """got {name: tensor} is reference's: the same names, each tensor of its dtype
    and shape and within rtol, atol of it (0, 0: bit for bit); the message names
    the tensor, `what` and how far apart."""
    assert set(got) == set(reference), "%s: names %s here, %s in the reference" % (
        what, sorted(got), sorted(reference))
    for n, want in reference.items():
        torch.testing.assert_close(got[n], want, rtol=rtol, atol=atol, equal_nan=False,
                                   msg=lambda m: "%s, %s: %s" % (what, n, m))
