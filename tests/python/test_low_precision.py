"""bfloat16 and float16 parameters, as torch's optimizers take them: states in
float32, the update computed in float32 and written back rounded to the
parameter's dtype. Every optimizer's step on such a model equals, bit for bit,
the same optimizer stepping float32 copies of the parameters (with the
gradients upcast) and rounding to nearest afterwards. rounding="stochastic":
each element takes one of the two neighbours of the float32 result (checked
against the float64 transcription of AdamW), unbiased: updates a quarter of a
unit in the last place keep a nearest-rounded parameter where it is and move a
stochastically rounded one as far as float64 does on average. A state_dict
round trip keeps the float32 states (torch's load casts them to the
parameter's dtype)."""
import os
import sys

import pytest
import torch
from torch import nn

import rfsdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import OPTIMIZERS, Net, data, optimizer  # noqa: E402

DTYPES = (torch.bfloat16, torch.float16)


def steps_against_float32(name, dtype, seed, rounding="nearest", steps=4):
    """Runs a low-precision model and a float32 twin reset to its values before
    every step (same gradients, upcast); yields (low-precision parameters, the
    twin's float32 results) after each step."""
    torch.manual_seed(seed)
    low = Net().to(dtype)
    twin = Net()
    for a, b in zip(twin.parameters(), low.parameters()):
        a.data.copy_(b.float())
    opt = optimizer(name, low.parameters(), rounding=rounding)
    ref = optimizer(name, twin.parameters())
    xs, ys = data(seed)
    for x, y in list(zip(xs, ys))[:steps]:
        loss = nn.functional.mse_loss(low(x.to(dtype)).float(), y)
        opt.zero_grad()
        loss.backward()
        with torch.no_grad():
            for a, b in zip(twin.parameters(), low.parameters()):
                a.copy_(b.float())
                a.grad = b.grad.float()
        opt.step()
        ref.step()
        yield list(low.parameters()), [p.detach().clone() for p in twin.parameters()]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_low_precision_step_is_the_float32_step_rounded_to_nearest(name, dtype):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    moved = 0
    for step, (got, want) in enumerate(steps_against_float32(name, dtype, seed)):
        for k, (p, w) in enumerate(zip(got, want)):
            assert p.dtype == dtype
            assert torch.equal(p.detach(), w.to(dtype)), "seed %d step %d parameter %d" % (
                seed, step, k)
            moved += int((p.detach().float() != w).any())
    opt = optimizer(name, Net().to(dtype).parameters())
    assert moved > 0  # the float32 results do need rounding
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()
    for st in opt.state.values():
        for key, t in st.items():
            assert t.dtype in (torch.float32, torch.uint8, torch.int64), (name, key, t.dtype)


def neighbours(x, dtype):
    """The two values of dtype around each float32 x (equal where x is one)."""
    y = x.to(dtype)
    bits = y.view(torch.int16)
    away = x.abs() > y.float().abs()
    z = torch.where(away, bits + 1, bits - 1).to(torch.int16).view(dtype)
    z = torch.where(y.float() == x, y, z)
    return torch.minimum(y, z), torch.maximum(y, z)


@pytest.mark.parametrize("dtype", DTYPES)
def test_stochastic_rounding_takes_a_neighbour_of_the_float64_result(dtype):
    """AdamW's step in float64 from the same state: the float32 step (a float32
    twin set to the parameter's values) lies within float32 rounding of it, and each
    element becomes one of the float32 result's two neighbours in dtype, the upper
    one in about the proportion its place between them says."""
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    gen = torch.Generator().manual_seed(seed)
    n, lr, b1, b2, eps, wd = 50_000, 1e-2, 0.9, 0.999, 1e-8, 0.1
    p = nn.Parameter(torch.randn(n, generator=gen).to(dtype))
    twin = nn.Parameter(p.detach().float())
    hyper = dict(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    opt = rfsdp.optim.AdamW([p], rounding="stochastic", **hyper)
    ref = rfsdp.optim.AdamW([twin], **hyper)
    b1, b2 = (torch.tensor(b, dtype=torch.float32).item() for b in (b1, b2))  # the kernels'
    m = torch.zeros(n, dtype=torch.float64)
    v = torch.zeros(n, dtype=torch.float64)
    ups = 0
    for step in (1, 2, 3):
        g = torch.randn(n, generator=gen).to(dtype)
        p64 = p.detach().double()
        m = b1 * m + (1 - b1) * g.double()
        v = b2 * v + (1 - b2) * g.double() ** 2
        want64 = p64 * (1 - lr * wd) - lr / (1 - b1 ** step) * m / (
            v.sqrt() / (1 - b2 ** step) ** 0.5 + eps)
        with torch.no_grad():
            twin.copy_(p.float())
        p.grad, twin.grad = g.clone(), g.float()
        opt.step()
        ref.step()
        want = twin.detach()
        torch.testing.assert_close(want.double(), want64, rtol=1e-6, atol=1e-6 * lr)
        lo, hi = neighbours(want, dtype)
        got = p.detach()
        assert ((got == lo) | (got == hi)).all(), "seed %d step %d: not a neighbour" % (seed, step)
        # P(hi) = (x - lo) / (hi - lo): the count of his within 6 sigma of its mean
        between = hi != lo
        frac = ((want.double() - lo.double()) / (hi.double() - lo.double()))[between]
        took_hi = (got == hi)[between].double()
        mean, sd = frac.sum().item(), (frac * (1 - frac)).sum().sqrt().item()
        assert abs(took_hi.sum().item() - mean) < 6 * sd + 1, \
            "seed %d step %d: %d rounded up, %g expected" % (seed, step, took_hi.sum().item(), mean)
        ups += int(took_hi.sum().item())
    assert ups > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_stochastic_rounding_moves_by_updates_below_half_a_unit_nearest_drops(dtype):
    one = torch.tensor(1.0, dtype=dtype)
    ulp = 1.0 - torch.nextafter(one, torch.zeros_like(one)).item()  # the spacing below 1
    lr, steps, n = ulp / 4, 16, 4096
    out = {}
    for rounding in ("nearest", "stochastic"):
        p = nn.Parameter(torch.ones(n, dtype=dtype))
        opt = rfsdp.optim.AdamW([p], lr=lr, weight_decay=0.0, rounding=rounding)
        for _ in range(steps):
            p.grad = torch.ones_like(p)  # every update is -lr (m^ / sqrt(v^) = 1)
            opt.step()
        out[rounding] = p.detach().double()
    assert torch.equal(out["nearest"], torch.ones(n, dtype=torch.float64))
    # each element: a sum of steps-many independent 0/ulp draws with mean lr each
    mean_drop = 1.0 - out["stochastic"].mean().item()
    assert abs(mean_drop - steps * lr) < 6 * ulp * (steps * 0.25 * 0.75 / n) ** 0.5 + 1e-3 * lr, \
        (mean_drop, steps * lr)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_state_dict_round_trip_keeps_the_float32_states(name):
    torch.manual_seed(0)
    models = [Net().to(torch.bfloat16) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [optimizer(name, m.parameters()) for m in models]
    xs, ys = data(0)

    def step(k, x, y):
        loss = nn.functional.mse_loss(models[k](x.to(torch.bfloat16)).float(), y)
        opts[k].zero_grad()
        loss.backward()
        opts[k].step()
    for x, y in list(zip(xs, ys))[:2]:
        step(0, x, y)
    opts[1].load_state_dict(opts[0].state_dict())
    models[1].load_state_dict(models[0].state_dict())
    for p0, p1 in zip(models[0].parameters(), models[1].parameters()):
        for key, t in opts[0].state[p0].items():
            assert torch.equal(opts[1].state[p1][key], t) and opts[1].state[p1][key].dtype == t.dtype
    for x, y in list(zip(xs, ys))[2:4]:
        step(0, x, y)
        step(1, x, y)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)


def test_bad_rounding_is_refused():
    with pytest.raises(ValueError, match="rounding must be"):
        rfsdp.optim.SOAP(Net().parameters(), rounding="up")
