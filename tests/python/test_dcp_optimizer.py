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
import tempfile

import pytest
import torch
from torch import nn

import rfsdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import Net, data, fsdp2, full_params, optimizer  # noqa: E402
from ranks import run_ranks  # noqa: E402

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
    per = xs.shape[1] // world
    for x, y in list(zip(xs, ys))[first:first + STEPS]:
        loss = nn.functional.mse_loss(model(x[rank * per:(rank + 1) * per]),
                                      y[rank * per:(rank + 1) * per])
        opt.zero_grad()
        loss.backward()
        opt.step()


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
    assert set(got["state"]) == set(want["state"]), what
    for fqn, st in want["state"].items():
        assert set(got["state"][fqn]) == set(st), (what, fqn)
        for k, t in st.items():
            g = got["state"][fqn][k]
            assert g.dtype == t.dtype and g.shape == t.shape, (what, fqn, k)
            assert torch.equal(g, t), "%s: %s.%s differs by %g" % (
                what, fqn, k, (g.double() - t.double()).abs().max().item())
    for a, b in zip(got["param_groups"], want["param_groups"]):
        assert a == b, what


def test_torch_dcp_optimizer_state_resumes_exactly_at_any_world_size():
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    with tempfile.TemporaryDirectory() as d:
        saved = run_ranks(worker, 2, seed, d, "save")[0]
        loaded = {world: run_ranks(worker, world, seed, d, "load")[0] for world in (2, 4)}
        fulls = {c: torch.load("%s/%s_%s_full.pt" % (d, *c), weights_only=False)["optim"]
                 for c in CASES}
        for world in (2, 4):
            got = loaded[world]
            for name, kind in CASES:
                want = fulls[(name, kind)]
                assert want["state"], (name, kind)
                for how in ("dcp", "full"):
                    what = "seed %d: %s on %s, %s, 2 -> %d ranks" % (seed, name, kind, how, world)
                    assert_equal_states(got[(name, kind, how, "state")], want, what)
                    if world == 2:  # same ranks, same sums: the uninterrupted run, bit for bit
                        for n, t in saved[(name, kind)].items():
                            assert torch.equal(got[(name, kind, how)][n], t), (what, n)


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
