"""optimizer.load_state_dict happens whole or not at all, for every optimizer: a
state dict that cannot load (another model's shapes, a missing state name, other
param groups) raises a ValueError saying nothing was loaded, and the optimizer
is exactly as before (its param groups, every state tensor, its step counts): the
next steps equal a run without the failed load."""
import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import OPTIMIZERS, Net, data, optimizer  # noqa: E402


def stepped(name, seed, model=None, lr_scale=1.0):
    torch.manual_seed(seed)
    model = model or Net()
    opt = optimizer(name, model.parameters())
    for g in opt.param_groups:
        g["lr"] *= lr_scale
    xs, ys = data(seed)
    for x, y in zip(xs[:2], ys[:2]):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def bad_state_dicts(name):
    """Saved by an optimizer over a model whose last layer differs (the state's
    shapes), with a state name missing, with a param group missing, each with
    another lr (the load must not take it)."""
    _, other = stepped(name, 1, Net(d=28), lr_scale=3.0)
    out = {"other shapes": other.state_dict()}
    _, same = stepped(name, 1, lr_scale=3.0)
    sd = same.state_dict()
    # (a state left empty would mean "no state": torch's load starts it over)
    first = next(st for st in sd["state"].values() if len([k for k in st if k != "step"]) > 1)
    del first[next(k for k in first if k != "step")]
    out["a state name missing"] = sd
    sd = same.state_dict()
    sd["param_groups"] = sd["param_groups"][:-1] if len(sd["param_groups"]) > 1 else []
    out["a param group missing"] = sd
    return out


def snapshot(opt):
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    state = {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    return groups, state


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_failed_load_changes_nothing(name):
    for what, sd in bad_state_dicts(name).items():
        model, opt = stepped(name, 0)
        before = snapshot(opt)
        with pytest.raises(ValueError, match="Nothing was loaded"):
            opt.load_state_dict(sd)
        after = snapshot(opt)
        assert after[0] == before[0], "%s, %s: the param groups changed" % (name, what)
        assert after[1].keys() == before[1].keys(), (name, what)
        for pid, st in before[1].items():
            for k, v in st.items():
                assert torch.equal(after[1][pid][k], v), (name, what, k)
        # and it steps on as if nothing had been tried
        ref_model, ref = stepped(name, 0)
        xs, ys = data(0)
        for m, o in ((model, opt), (ref_model, ref)):
            nn.functional.mse_loss(m(xs[2]), ys[2]).backward()
            o.step()
        for a, b in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(a, b), (name, what)
