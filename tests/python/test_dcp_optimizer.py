"""torch DCP's own optimizer checkpoints, the way torchtitan and most FSDP2 trainers
take them, with rfsdp's optimizers on models sharded by torch's FSDP2 and by
rfsdp.fully_shard: get_optimizer_state_dict / set_optimizer_state_dict with
dcp.save / dcp.load (sharded), and with full_state_dict=True (cpu_offload on the
way out; every rank's file on the way in, or broadcast from rank 0).

Saved on 2 ranks after 3 steps; loaded on 2 ranks (the run continued 3 steps must
equal the uninterrupted one bit for bit) and on 4 (the optimizer state read back
whole must equal the saved one bit for bit, every tensor: codes, scales, tiles,
step counts). And a state saved with other settings is refused."""
import os
import sys

import pytest
import torch

import rfsdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import Net, data, fsdp2, full_params, optimizer  # noqa: E402
from ranks import run_ranks  # noqa: E402
from slice_training import assert_trains_like, train_on_slices  # noqa: E402

CASES = [(name, kind) for name in ("AdamW", "AdamW8bit", "Muon", "Shampoo", "SOAP")
         for kind in ("fsdp2", "rfsdp")]
STEPS = 3


def sharded(name, kind, world, seed):
    torch.manual_seed(seed)
    model = Net()
    if kind == "fsdp2":
        fsdp2(model, world)
    else:
        pol = rfsdp.policy.shampoo(1024) if name in ("Shampoo", "SOAP") else None
        for b in model.blocks:
            rfsdp.fully_shard(b, policy=pol)
        rfsdp.fully_shard(model, policy=pol)
    return model, optimizer(name, model.parameters())


def train(model, opt, seed, rank, world, first):
    xs, ys = data(seed)
    train_on_slices(model, opt, xs[first:first + STEPS], ys[first:first + STEPS], rank, world)


def options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(**kw)


def worker(rank, world, seed, d, phase):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)
    out = {}
    for name, kind in CASES:
        case = "%s/%s_%s" % (d, name, kind)
        if phase == "save":
            model, opt = sharded(name, kind, world, seed)
            train(model, opt, seed, rank, world, 0)
            dcp.save({"model": get_model_state_dict(model),
                      "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=case + "_ck")
            o = options(full_state_dict=True, cpu_offload=True)
            full = {"model": get_model_state_dict(model, options=o),
                    "optim": get_optimizer_state_dict(model, opt, options=o)}
            if rank == 0:
                torch.save(full, case + "_full.pt")
            train(model, opt, seed, rank, world, STEPS)
            out[(name, kind)] = full_params(model)
            continue
        for how in ("dcp", "full"):
            model, opt = sharded(name, kind, world, seed + 1)  # other values: all must load
            if how == "dcp":
                sd = {"model": get_model_state_dict(model),
                      "optim": get_optimizer_state_dict(model, opt)}
                dcp.load(sd, checkpoint_id=case + "_ck")
                set_model_state_dict(model, sd["model"])
                set_optimizer_state_dict(model, opt, sd["optim"])
            else:
                sd = torch.load(case + "_full.pt", weights_only=False)
                o = options(full_state_dict=True, broadcast_from_rank0=world > 2)
                set_model_state_dict(model, sd["model"], options=o)
                set_optimizer_state_dict(model, opt, sd["optim"], options=o)
            o = options(full_state_dict=True, cpu_offload=True)
            out[(name, kind, how, "state")] = get_optimizer_state_dict(model, opt, options=o)
            train(model, opt, seed, rank, world, STEPS)
            out[(name, kind, how)] = full_params(model)
    return out if rank == 0 else None


def assert_equal_states(got, want, what):
    """Every tensor of every parameter's state bit for bit (dtype and shape too), and
    the param_groups."""
    assert set(got["state"]) == set(want["state"]), what
    for fqn, st in want["state"].items():
        assert_trains_like(st, got["state"][fqn], what="%s: %s" % (what, fqn))
    assert got["param_groups"] == want["param_groups"], what


@pytest.fixture(scope="module")
def seed():
    return int(torch.randint(0, 2 ** 30, ()).item())


@pytest.fixture(scope="module")
def runs(seed, tmp_path_factory):
    """Saved on 2 ranks (rank 0's results), loaded on 2 and on 4 ({world: rank 0's
    results}), the full state dicts saved ({case: optimizer state}): once for the
    module."""
    d = str(tmp_path_factory.mktemp("dcp_optimizer"))
    saved = run_ranks(worker, 2, seed, d, "save")[0]
    loaded = {world: run_ranks(worker, world, seed, d, "load")[0] for world in (2, 4)}
    fulls = {c: torch.load("%s/%s_%s_full.pt" % (d, *c), weights_only=False)["optim"]
             for c in CASES}
    return saved, loaded, fulls


@pytest.mark.parametrize("name,kind", CASES)
def test_the_saved_optimizer_state_is_not_empty(runs, name, kind):
    _, _, fulls = runs
    assert fulls[(name, kind)]["state"], (name, kind)


@pytest.mark.parametrize("how", ["dcp", "full"])
@pytest.mark.parametrize("name,kind", CASES)
@pytest.mark.parametrize("world", [2, 4])
def test_the_state_read_back_at_any_world_size_equals_the_saved(runs, seed, world, name, kind,
                                                               how):
    _, loaded, fulls = runs
    assert_equal_states(loaded[world][(name, kind, how, "state")], fulls[(name, kind)],
                        "seed %d: %s on %s, %s, 2 -> %d ranks" % (seed, name, kind, how, world))


@pytest.mark.parametrize("how", ["dcp", "full"])
@pytest.mark.parametrize("name,kind", CASES)
def test_a_resume_on_the_same_ranks_continues_bit_for_bit(runs, seed, name, kind, how):
    """Same ranks, same sums: the uninterrupted run, bit for bit."""
    saved, loaded, _ = runs
    assert_trains_like(saved[(name, kind)], loaded[2][(name, kind, how)],
                       what="seed %d: %s on %s, %s, 2 -> 2 ranks" % (seed, name, kind, how))


def test_a_state_saved_with_other_settings_is_refused():
    model = Net()
    a = rfsdp.optim.AdamW8bit(model.parameters(), block=256, min_8bit_size=64)
    b = rfsdp.optim.AdamW8bit(model.parameters(), block=128, min_8bit_size=64)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    a.step()
    with pytest.raises(ValueError, match='saved by an optimizer with the settings.*"block": 256'):
        b.load_state_dict(a.state_dict())
    assert not b.state
