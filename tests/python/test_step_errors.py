"""Any error inside a step is the same error on every rank, at once: on 2 and 3
ranks (processes, Gloo), a failure on one rank only (a Shampoo root of one rank's
tile, a Muon root of one rank's matrix, a bad gradient handed to one rank's
optimizer) makes every rank raise the same message naming the tensor and the rank,
in seconds (no collective timeout: the optimizers' is 30 s here), with no
parameter or state changed anywhere; the ranks then step on together. And before
the first step: ranks whose models differ, or that shard their blocks in another
order, refuse in fully_shard on every rank instead of aborting inside Gloo."""
import os
import sys
import time

import pytest
import torch
from torch import nn

import rfsdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import Net, data  # noqa: E402
from test_nonfinite import slice_backward, snapshot  # noqa: E402
from ranks import run_ranks  # noqa: E402

TIMEOUT = 30  # seconds: a rank waiting for a peer that raised alone would wait this long


def shard(model, pol=None):
    for b in model.blocks:
        rfsdp.fully_shard(b, policy=pol)
    rfsdp.fully_shard(model, policy=pol)


def same_state(a, b):
    """Parameters and optimizer state equal, NaN equal to NaN."""
    def eq(x, y):
        return x.shape == y.shape and torch.equal(x.isnan(), y.isnan()) and \
            torch.equal(x.nan_to_num(0), y.nan_to_num(0))
    return all(eq(a[0][n], b[0][n]) for n in a[0]) and a[1].keys() == b[1].keys() and \
        all(eq(a[1][i][k], b[1][i][k]) for i in a[1] for k in a[1][i])


def failing_optimizer(case, model):
    """(optimizer, steps within which it fails, the state to corrupt on one rank).
    Shampoo: NaN left factors make its roots there fail, three times in a row by the
    fourth root update. Muon: a NaN momentum in one rank's piece of a matrix makes
    that rank's update non-finite (and the matrix's root's Newton-Schulz result)."""
    if case == "shampoo":
        return rfsdp.optim.Shampoo(model.parameters(), lr=1e-2, max_preconditioner_dim=8,
                                   precondition_frequency=1, start_preconditioning_step=1,
                                   epsilon=1e-6, timeout_seconds=TIMEOUT), 4, "factor_left"
    matrices = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
    ids = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return rfsdp.optim.Muon([dict(params=matrices), dict(params=rest, use_muon=False)], lr=0.02,
                            timeout_seconds=TIMEOUT), 2, "momentum_buffer"


def worker(rank, world, case, seed):
    torch.manual_seed(seed)
    model = Net()
    shard(model, rfsdp.policy.shampoo(8) if case == "shampoo" else None)
    failing = world - 1
    opt, steps, corrupt = failing_optimizer(case, model)
    backward = slice_backward(opt, model, *data(seed), rank, world)
    backward(0)
    opt.step()  # the state exists now
    # The corrupted tensor: the failing rank's first non-empty one of that name.
    target = None
    if rank == failing:
        for p in model.parameters():
            st = opt.state.get(p, {})
            if corrupt in st and st[corrupt].numel() > 0:
                target = st[corrupt]
                break
        target.fill_(float("nan"))
    error, seconds = None, 0.0
    for step in range(1, steps + 1):
        backward(step)
        before = snapshot(model, opt)
        t0 = time.time()
        try:
            opt.step()
        except RuntimeError as e:
            error, seconds = str(e), time.time() - t0
            unchanged = same_state(before, snapshot(model, opt))
            break
    else:
        unchanged = None
    # The state mended (as loading a checkpoint would): the ranks step on together.
    if target is not None:
        target.zero_()
    backward(steps + 1)
    opt.step()
    return {"error": error, "seconds": seconds, "unchanged": unchanged}


def bad_gradient_worker(rank, world, seed):
    """One rank hands its optimizer a non-contiguous gradient: a ValueError on every rank."""
    torch.manual_seed(seed)
    model = Net()
    shard(model)
    opt = rfsdp.optim.AdamW(model.parameters(), lr=1e-2, timeout_seconds=TIMEOUT)
    xs, ys = data(seed)
    nn.functional.mse_loss(model(xs[0]), ys[0]).backward()
    if rank == world - 1:
        p = next(p for p in model.parameters() if p.dim() == 2 and min(p.shape) > 1)
        g = torch.empty(tuple(p.shape)[::-1]).t()  # the same shape, transposed strides
        g.copy_(p.grad)
        p.grad = g
    before = snapshot(model, opt)
    t0 = time.time()
    try:
        opt.step()
        error = None
    except ValueError as e:
        error = str(e)
    seconds = time.time() - t0
    unchanged = same_state(before, snapshot(model, opt))
    for p in model.parameters():
        if p.grad is not None:
            p.grad = p.grad.contiguous()
    opt.step()  # the ranks step on together
    return {"error": error, "seconds": seconds, "unchanged": unchanged}



def key_error_worker(rank, world, seed):
    """One rank's param group lost a key (any exception type, not only the four
    the agreement used to catch): every rank raises it at once."""
    torch.manual_seed(seed)
    model = Net()
    shard(model)
    opt = rfsdp.optim.AdamW(model.parameters(), lr=1e-2, timeout_seconds=TIMEOUT)
    xs, ys = data(seed)
    nn.functional.mse_loss(model(xs[0]), ys[0]).backward()
    if rank == world - 1:
        lr = opt.param_groups[0].pop("lr")
    before = snapshot(model, opt)
    t0 = time.time()
    try:
        opt.step()
        error = None
    except ValueError as e:
        error = str(e)
    seconds = time.time() - t0
    unchanged = same_state(before, snapshot(model, opt))
    if rank == world - 1:
        opt.param_groups[0]["lr"] = lr
    opt.step()  # the ranks step on together
    return {"error": error, "seconds": seconds, "unchanged": unchanged}


def check_agreed(got, world, *fragments):
    for r, g in enumerate(got):
        assert g["error"] is not None, "rank %d took the step" % r
        assert g["error"] == got[0]["error"], "rank %d: %s\nrank 0: %s" % (r, g["error"],
                                                                           got[0]["error"])
        assert g["seconds"] < TIMEOUT / 3, "rank %d waited %.1f s" % (r, g["seconds"])
        assert g["unchanged"], "rank %d changed parameters or state" % r
    for f in fragments + ("not taken on any rank",):
        assert f in got[0]["error"], got[0]["error"]


@pytest.mark.parametrize("world", [2, 3])
def test_a_shampoo_root_failure_on_one_rank_stops_every_rank(world):
    got = run_ranks(worker, world, "shampoo", int(torch.randint(0, 2 ** 30, ()).item()))
    check_agreed(got, world, "Shampoo step: the inverse roots of parameter", "3 times in a row",
                 "(on rank %d" % (world - 1))


@pytest.mark.parametrize("world", [2, 3])
def test_a_muon_root_failure_on_one_rank_stops_every_rank(world):
    got = run_ranks(worker, world, "muon", int(torch.randint(0, 2 ** 30, ()).item()))
    # (the failing rank's NaN momentum is its own finding: it outranks what the
    # matrix's root computed from it)
    check_agreed(got, world, "Muon step: the momentum of parameter", "overflowed",
                 "(on rank %d" % (world - 1))


def test_a_bad_gradient_on_one_rank_is_a_value_error_on_every_rank():
    got = run_ranks(bad_gradient_worker, 2, int(torch.randint(0, 2 ** 30, ()).item()))
    check_agreed(got, 2, "AdamW step: ValueError: AdamW: the gradient of parameter 'embed.weight' "
                 "must be a contiguous float32 tensor of 28 elements on cpu (the parameter's "
                 "device); got a non-contiguous tensor of 28 Float elements on cpu",
                 "(on rank 1)")


def desync_worker(rank, world, seed):
    """Rank 1 catches an exception of its own code mid-step and goes on to the next
    batch: its next collective is not rank 0's. Every rfsdp collective checks in
    first, so both ranks raise the same error, naming what each was doing."""
    torch.manual_seed(seed)
    model = Net()
    shard(model)
    opt = rfsdp.optim.AdamW(model.parameters(), lr=1e-2, timeout_seconds=TIMEOUT)
    xs, ys = data(seed)
    t0, error = time.time(), None
    try:
        for step in range(4):
            loss = nn.functional.mse_loss(model(xs[step]), ys[step])
            if rank == 1 and step == 1:
                try:
                    raise RuntimeError("a bad batch")
                except RuntimeError:
                    continue  # one rank skips the rest of this step
            opt.zero_grad()
            loss.backward()
            opt.step()
    except RuntimeError as e:
        error = str(e)
    return {"error": error, "seconds": time.time() - t0}


def test_a_rank_that_skips_part_of_a_step_is_an_error_on_every_rank():
    got = run_ranks(desync_worker, 2, int(torch.randint(0, 2 ** 30, ()).item()))
    for r, g in enumerate(got):
        assert g["error"] is not None, "rank %d went on" % r
        assert g["seconds"] < TIMEOUT / 3, "rank %d waited %.1f s" % (r, g["seconds"])
        for f in ("collectives out of step on a group of 2 ranks: rank 0 is at its collective #",
                  "rank 1 is at its collective #", "A rank skipped part of a step"):
            assert f in g["error"], g["error"]
    assert got[0]["error"] == got[1]["error"]


def test_a_key_error_on_one_rank_is_every_ranks_error_at_once():
    got = run_ranks(key_error_worker, 2, int(torch.randint(0, 2 ** 30, ()).item()))
    check_agreed(got, 2, "AdamW step: KeyError: 'lr'", "(on rank 1)")


# ---- before the first step: fully_shard agrees ---------------------------------------------

class Wide(nn.Module):
    def __init__(self, out):
        super().__init__()
        self.a = nn.Linear(24, 24)
        self.b = nn.Linear(24, out)


def mismatch_worker(rank, world, how):
    t0 = time.time()
    try:
        if how == "shapes":  # rank 1 builds Linear(24, 25) where rank 0 builds Linear(24, 24)
            model = Wide(25 if rank == 1 else 24)
            rfsdp.fully_shard(model.b)
            rfsdp.fully_shard(model)
        else:  # equal blocks, sharded in another order on rank 1
            model = Net()
            order = list(model.blocks)[::-1] if rank == 1 else list(model.blocks)
            for b in order:
                rfsdp.fully_shard(b)
            rfsdp.fully_shard(model)
        error = None
    except ValueError as e:
        error = str(e)
    return {"error": error, "seconds": time.time() - t0}


@pytest.mark.parametrize("how,fragments", [
    ("shapes", ["fully_shard(Linear) differs between ranks",
                "rank 0 has 'parameter 'weight': shape [24, 24]",
                "rank 1 has 'parameter 'weight': shape [25, 24]"]),
    ("order", ["fully_shard(Net) differs between ranks",
               "rank 0 has 'inner fully_shard of 'blocks.0': call 0'",
               "rank 1 has 'inner fully_shard of 'blocks.0': call 2'"]),
])
def test_ranks_that_shard_different_models_refuse_together(how, fragments):
    got = run_ranks(mismatch_worker, 2, how)
    for r, g in enumerate(got):
        assert g["error"] is not None, "rank %d sharded" % r
        assert g["error"] == got[0]["error"]
        assert g["seconds"] < 20, g["seconds"]
    for f in fragments:
        assert f in got[0]["error"], got[0]["error"]
