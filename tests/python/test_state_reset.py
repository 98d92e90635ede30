"""Resetting optimizer state as torch.optim's users do (after a loss spike,
between curriculum phases) resets what it resets in torch's optimizers, for
every rfsdp optimizer on every path (one process, rfsdp.fully_shard and FSDP2 on
2 ranks, 8-bit states): clearing opt.state, replacing it, or loading a fresh
optimizer's state_dict starts every parameter's state over (the run equals one
that built a new optimizer there); writing a state's "step" sets the step
count (the run equals one that loaded a state dict with that count); a state
tensor replaced by another of its shape is taken; a write that cannot be
honoured is an error, not a no-op. torch.optim.AdamW is the control."""
import collections
import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import OPTIMIZERS, Net, data, fsdp2, optimizer  # noqa: E402
from ranks import run_ranks  # noqa: E402
from slice_training import assert_trains_like  # noqa: E402

AT = 3  # the step before which the state is reset (of models.STEPS = 6)


def new_optimizer(opt, name, model, make):
    return make(name, model.parameters())


def clear(opt, name, model, make):
    opt.state.clear()
    return opt


def new_dict(opt, name, model, make):
    opt.state = collections.defaultdict(dict)
    return opt


def load_fresh(opt, name, model, make):
    opt.load_state_dict(make(name, model.parameters()).state_dict())
    return opt


def write_steps(opt, name, model, make):
    for st in opt.state.values():
        if "step" in st:
            st["step"].fill_(1)
    return opt


def load_steps(opt, name, model, make):
    """write_steps' reference: a state dict with those counts, loaded into a new optimizer."""
    sd = opt.state_dict()
    for st in sd["state"].values():
        if "step" in st:
            st["step"] = torch.tensor(1.0)
    new = make(name, model.parameters())
    new.load_state_dict(sd)
    return new


RESETS = {"opt.state.clear()": clear, "opt.state = defaultdict(dict)": new_dict,
          "load_state_dict(fresh)": load_fresh}


def run(name, seed, change=None, shard=None, make=optimizer):
    torch.manual_seed(seed)
    model = Net()
    if shard == "rfsdp":
        import rfsdp
        for b in model.blocks:
            rfsdp.fully_shard(b)
        rfsdp.fully_shard(model)
    elif shard == "fsdp2":
        fsdp2(model, torch.distributed.get_world_size())
    opt = make(name, model.parameters())
    xs, ys = data(seed)
    for step, (x, y) in enumerate(zip(xs, ys)):
        if change is not None and step == AT:
            opt = change(opt, name, model, make)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    from models import full_params
    return {n: t.detach().clone() for n, t in full_params(model).items()}


def all_runs(seed, shard):
    out = {}
    for name in OPTIMIZERS:
        out[name, "none"] = run(name, seed, None, shard)
        out[name, "new optimizer"] = run(name, seed, new_optimizer, shard)
        for way, change in RESETS.items():
            out[name, way] = run(name, seed, change, shard)
        out[name, "write steps"] = run(name, seed, write_steps, shard)
        out[name, "load steps"] = run(name, seed, load_steps, shard)
    return out


def _on_ranks(rank, world, seed, shard):
    return all_runs(seed, shard)


@pytest.fixture(scope="module")
def results():
    seed = 11
    out = {"one process": all_runs(seed, None)}
    for shard in ("rfsdp", "fsdp2"):
        out[shard] = run_ranks(_on_ranks, 2, seed, shard, timeout=600)[0]
    return out


PATHS = ("one process", "rfsdp", "fsdp2")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("way", list(RESETS))
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_reset_equals_a_new_optimizer(results, path, way, name):
    r = results[path]
    assert_trains_like(r[name, "new optimizer"], r[name, way], what="%s %s %s" % (path, name, way))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_reset_changes_the_run(results, path, name):
    """(So the comparisons above can fail.)"""
    r = results[path]
    assert any(not torch.equal(r[name, "none"][n], r[name, "new optimizer"][n])
               for n in r[name, "none"])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if n != "Muon"])
def test_a_step_written_equals_a_state_dict_loaded_with_it(results, path, name):
    """(Muon's matrices keep no step, as torch.optim.Muon's: its AdamW part does.)"""
    r = results[path]
    assert_trains_like(r[name, "load steps"], r[name, "write steps"], what="%s %s" % (path, name))
    assert any(not torch.equal(r[name, "none"][n], r[name, "write steps"][n])
               for n in r[name, "none"])


def torch_adamw(name, params):
    return torch.optim.AdamW(list(params), lr=1e-2, weight_decay=0.05)


@pytest.mark.parametrize("way", list(RESETS) + ["write steps"])
def test_adamw_resets_as_torch_adamw_does(way):
    change = RESETS.get(way, write_steps)
    want = run("AdamW", 5, change, make=torch_adamw)
    got = run("AdamW", 5, change)
    assert_trains_like(want, got, 0, 1e-6)
    # torch's own reset is what the tests above call a new optimizer
    fresh = run("AdamW", 5, new_optimizer, make=torch_adamw)
    if way != "write steps":
        for n in want:
            assert torch.equal(want[n], fresh[n])


def test_removing_one_parameters_state_resets_it_alone_as_torch_does():
    def pop_first(opt, name, model, make):
        del opt.state[next(iter(model.parameters()))]
        return opt
    want = run("AdamW", 6, pop_first, make=torch_adamw)
    got = run("AdamW", 6, pop_first)
    assert_trains_like(want, got, 0, 1e-6)


def _stepped(name="AdamW8bit"):
    model = Net()
    opt = optimizer(name, model.parameters())
    x, y = data(0)
    nn.functional.mse_loss(model(x[0]), y[0]).backward()
    opt.step()
    return model, opt


def test_a_state_tensor_replaced_by_one_of_its_shape_is_taken():
    model, opt = _stepped("AdamW")
    p = model.head.weight
    new = torch.full_like(opt.state[p]["exp_avg"], 0.25)
    opt.state[p]["exp_avg"] = new
    sd = opt.state_dict()
    index = next(k for k, q in enumerate(q for g in opt.param_groups for q in g["params"])
                 if q is p)
    assert torch.equal(sd["state"][index]["exp_avg"], new)
    assert opt.state[p]["exp_avg"] is not new  # the optimizer's own tensor, holding its values


@pytest.mark.parametrize("write,match", [
    (lambda st: st.__setitem__("exp_avg", torch.zeros(3)), "must be a tensor of shape"),
    (lambda st: st.__setitem__("momentum", torch.zeros(3)), "a name added or removed"),
    (lambda st: st.__delitem__("exp_avg_sq"), "a name added or removed"),
    (lambda st: st.__setitem__("step", torch.tensor(-1.0)), "whole number >= 0"),
])
def test_a_write_that_cannot_be_honoured_is_an_error(write, match):
    model, opt = _stepped("AdamW")
    write(opt.state[model.head.weight])
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        opt.step()
    for a, p in zip(before, model.parameters()):
        assert torch.equal(a, p)


def replace_steps(opt, name, model, make):
    for st in opt.state.values():
        if "step" in st:
            st["step"] = torch.tensor(1.0)  # (another tensor, not a write into the published one)
    return opt


def clear_entries(opt, name, model, make):
    for st in list(opt.state.values()):
        st.clear()  # each entry emptied in place
    return opt


def move_state(opt, name, model, make):
    """The state moved into a new optimizer entry by entry (parameters not stepped there)."""
    new = make(name, model.parameters())
    for p, st in opt.state.items():
        new.state[p] = {k: v.clone() for k, v in st.items()}
    return new


@pytest.mark.parametrize("change", [replace_steps, clear_entries, move_state],
                         ids=["step replaced", "entries emptied", "state moved"])
def test_other_writes_are_followed_as_torch_adamw_follows_them(change):
    want = run("AdamW", 8, change, make=torch_adamw)
    got = run("AdamW", 8, change)
    assert_trains_like(want, got, 0, 1e-6)
    plain = run("AdamW", 8, make=torch_adamw)
    assert any(not torch.equal(plain[n], want[n]) for n in want) or change is move_state
