"""A NaN in one rank's gradient slice only, on 2 ranks (processes, Gloo): every
optimizer raises the same clear error on both ranks at once (no collective
timeout), naming that rank's gradient, changes no parameter and no state on
either, and the ranks step on together afterwards."""
import os
import sys
import time

import pytest
import torch
from torch import nn

import rfsdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import Net, data  # noqa: E402
from ranks import run_ranks  # noqa: E402

WORLD = 2


def make_optimizer(name, model):
    if name == "adamw":
        return rfsdp.optim.AdamW(model.parameters(), lr=1e-2, timeout_seconds=30)
    if name == "adamw8bit":
        return rfsdp.optim.AdamW8bit(model.parameters(), lr=1e-2, block=256, min_8bit_size=16,
                                     timeout_seconds=30)
    if name == "shampoo":
        return rfsdp.optim.Shampoo(model.parameters(), lr=1e-2, max_preconditioner_dim=8,
                                   precondition_frequency=1, start_preconditioning_step=1,
                                   epsilon=1e-6, timeout_seconds=30)
    if name.startswith("soap"):  # a basis refresh is due at the NaN step (the second)
        return rfsdp.optim.SOAP(model.parameters(), lr=1e-2, max_preconditioner_dim=8,
                                precondition_frequency=1, timeout_seconds=30)
    matrices = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
    ids = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return rfsdp.optim.Muon([dict(params=matrices), dict(params=rest, use_muon=False)],
                            lr=0.02, timeout_seconds=30)


def snapshot(model, opt):
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {i: {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
             for i, s in enumerate(opt.state.values())}
    return params, state


def slice_backward(opt, model, xs, ys, rank, world):
    """backward(step): zero the gradients, then backward on this rank's slice of batch step."""
    per = xs.shape[1] // world

    def backward(step):
        opt.zero_grad()
        x, y = xs[step, rank * per:(rank + 1) * per], ys[step, rank * per:(rank + 1) * per]
        nn.functional.mse_loss(model(x), y).backward()
    return backward


def worker(rank, world, name, seed):
    torch.manual_seed(seed)
    model = Net()
    # ("soap-cut": no tile policy, so shard boundaries cut rows of tiles, which go to
    # an owner: a NaN in rank 1's rows reaches rank 0's basis refresh)
    pol = {"adamw8bit": rfsdp.policy.blockwise_8bit(256),
           "shampoo": rfsdp.policy.shampoo(8), "soap": rfsdp.policy.shampoo(8)}.get(name)
    for b in model.blocks:
        rfsdp.fully_shard(b, policy=pol)
    rfsdp.fully_shard(model, policy=pol)
    opt = make_optimizer(name, model)
    xs, ys = data(seed)
    backward = slice_backward(opt, model, xs, ys, rank, WORLD)
    backward(0)
    opt.step()  # the state exists now
    backward(1)
    nan_in = None
    if rank == 1:  # one element of this rank's rows of a matrix both ranks hold where one is
        # (8-bit blocks of 256 keep these matrices whole on one rank: then any of its shards)
        named = [(n, p) for n, p in model.named_parameters() if p.numel() > 0]
        nan_in, p = next(((n, p) for n, p in named if n == "blocks.1.fc.weight" and
                          p.numel() < rfsdp.shard_info(p).global_numel), named[0])
        p.grad.view(-1)[p.grad.numel() // 2] = float("nan")
    before = snapshot(model, opt)
    t0 = time.time()
    try:
        opt.step()
        error = None
    except RuntimeError as e:
        error = str(e)
    seconds = time.time() - t0
    after = snapshot(model, opt)
    unchanged = all(torch.equal(before[0][n], after[0][n]) for n in before[0]) and \
        before[1].keys() == after[1].keys() and \
        all(torch.equal(before[1][i][k], after[1][i][k]) for i in before[1] for k in before[1][i])
    backward(2)  # the ranks go on together
    opt.step()
    return {"error": error, "seconds": seconds, "unchanged": unchanged, "nan_in": nan_in}


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "muon", "shampoo", "soap", "soap-cut"])
def test_nan_on_one_rank_stops_every_rank_naming_its_gradient(name):
    """The error names rank 1's gradient, not what another rank computed from its
    rows (Muon's root's Newton-Schulz result, SOAP's owner's basis refresh)."""
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    got = run_ranks(worker, WORLD, name, seed)
    for r, g in enumerate(got):
        assert g["error"] is not None, "rank %d took the step" % r
        assert "the gradient of parameter '%s' holds NaN or Inf (on rank 1" % got[1]["nan_in"] \
            in g["error"] and "not taken on any rank" in g["error"], g["error"]
    if name in ("muon", "soap-cut"):  # (where another rank computes from rank 1's rows)
        assert got[1]["nan_in"] == "blocks.1.fc.weight"
        assert g["seconds"] < 10, "rank %d waited %.1f s" % (r, g["seconds"])
        assert g["unchanged"], "rank %d changed parameters or state" % r
    assert got[0]["error"] == got[1]["error"]
