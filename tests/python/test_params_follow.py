"""Optimizers follow their parameters, as torch.optim's do: a step works on the
tensor each parameter holds then. model.to(torch.device("cpu", 0)) (what
accelerate's prepare_model does), .double() then .float(), load_state_dict
(assign=True) (swapping tensors into the Parameters) and p.data = ... replace
every parameter's storage after the
optimizer was built; each is done before the first step and again after two
(state present), and every optimizer's run must equal, bit for bit, the same
run without them. A rebuild of the C++ optimizers (what a move to another
device does) carries the state exactly."""
import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import OPTIMIZERS, Net, data, optimizer  # noqa: E402


def to_cpu0(model, opt):
    model.to(torch.device("cpu", 0))


def double_then_float(model, opt):
    model.double()
    model.float()


def assign_state_dict(model, opt):
    # Without swap_module_params_on_conversion, assign=True puts new Parameter
    # objects into the model, which no optimizer built before holds (torch.optim's
    # neither); with it, the Parameters stay and take the new tensors' storage.
    before = list(model.parameters())
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    assert all(a is b for a, b in zip(before, model.parameters()))


def replace_data(model, opt):
    for p in model.parameters():
        p.data = p.data.clone()


def rebuild(model, opt):
    opt._bind(force=True)


CHANGES = {"to cpu:0": to_cpu0, "double then float": double_then_float,
           "load_state_dict(assign=True)": assign_state_dict, "p.data = ...": replace_data,
           "rebuilt": rebuild}


def train(name, seed, change=None, shard=False):
    """Every step of `name` on Net, change() before steps 0 and 2; the parameters
    after (whole ones where shard: rfsdp.fully_shard on each block and the model)."""
    import rfsdp
    torch.manual_seed(seed)
    model = Net()
    if shard:
        for b in model.blocks:
            rfsdp.fully_shard(b)
        rfsdp.fully_shard(model)
    opt = optimizer(name, model.parameters())
    xs, ys = data(seed)
    for step, (x, y) in enumerate(zip(xs, ys)):
        if change is not None and step in (0, 2):
            change(model, opt)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if shard:
        return list(rfsdp.full_parameters(model).values())
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_step_after_the_storage_changed_equals_the_run_without(name, change):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    want = train(name, seed)
    got = train(name, seed, CHANGES[change])
    start = [p.detach() for p in (torch.manual_seed(seed), Net())[1].parameters()]
    assert all(not torch.equal(a, b) for a, b in zip(want, start)), "the run moves every parameter"
    for k, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), "seed %d: parameter %d differs by %g" % (
            seed, k, (a - b).abs().max().item())


def test_a_parameter_of_another_shape_or_dtype_is_refused_when_stepped():
    model = Net()
    opt = optimizer("AdamW", model.parameters())
    model.head.weight.data = torch.zeros(3, 3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(ValueError, match="holds 9 elements"):
        opt.step()
    model = Net()
    opt = optimizer("Muon", model.parameters())
    model.double()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(ValueError, match="Double tensor.*MixedPrecisionPolicy"):
        opt.step()


@pytest.mark.parametrize("name", ["AdamW", "Muon"])
def test_fully_shard_keeps_its_shards_in_place_through_model_to(one_rank, name):
    """model.to(cpu:0) on an rfsdp model: the shards stay views of the unit's flat
    buffer (the collectives read it), so training goes on as without the call; a
    conversion to another dtype is refused before anything changes."""
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    want = train(name, seed, shard=True)
    got = train(name, seed, to_cpu0, shard=True)
    for k, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), (seed, k)
    import rfsdp
    model = Net()
    rfsdp.fully_shard(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="after fully_shard would move the shards.*"
                                         "MixedPrecisionPolicy.*Nothing was changed"):
        model.to(torch.bfloat16)
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, before[n]), n
