"""rfsdp.optim as torch.optim.Optimizers over the C++ optimizers, one process:
param groups with their own hyperparameters, an LR scheduler and parameters
that skip steps (each counts its own) give torch.optim.AdamW's parameters;
state_dict / load_state_dict carry the C++ state (8-bit codes included) so that
a loaded optimizer steps on exactly like the one it came from."""
import pytest
import torch
from torch import nn

import rfsdp


def params_and_grads(seed, steps):
    g = torch.Generator().manual_seed(seed)
    shapes = [(70, 64), (64,), (9, 5, 4), ()]
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]
    return init, grads


def test_groups_scheduler_and_skipped_steps_match_torch_adamw():
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    steps = 6
    init, grads = params_and_grads(seed, steps)
    runs = []
    for cls in (torch.optim.AdamW, rfsdp.optim.AdamW):
        ps = [nn.Parameter(t.clone()) for t in init]
        opt = cls([dict(params=ps[:2], lr=3e-2, weight_decay=0.1),
                   dict(params=ps[2:], lr=1e-2, betas=(0.8, 0.95), weight_decay=0.0)],
                  lr=1e-3, eps=1e-8)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        for s in range(steps):
            for i, (p, g) in enumerate(zip(ps, grads[s])):
                # parameter 3 skips odd steps, parameter 1 the first two
                p.grad = None if (i == 3 and s % 2) or (i == 1 and s < 2) else g.clone()
            opt.step()
            sched.step()
        runs.append([p.detach() for p in ps])
    for i, (a, b) in enumerate(zip(*runs)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: "param %d (seed %d): %s" % (i, seed, m))


@pytest.mark.parametrize("cls", ["adamw", "adamw8bit"])
def test_loaded_optimizer_steps_on_like_the_original(cls):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    init, grads = params_and_grads(seed, 5)
    make = {"adamw": lambda ps: rfsdp.optim.AdamW(ps, lr=1e-2),
            "adamw8bit": lambda ps: rfsdp.optim.AdamW8bit(ps, lr=1e-2, min_8bit_size=256)}[cls]
    a = [nn.Parameter(t.clone()) for t in init]
    opt_a = make(a)
    for s in range(3):
        for p, g in zip(a, grads[s]):
            p.grad = g.clone()
        opt_a.step()
    sd = opt_a.state_dict()
    if cls == "adamw8bit":
        assert sd["state"][0]["q1"].numel() == 70 * 64  # the 8-bit codes are saved
    b = [nn.Parameter(p.detach().clone()) for p in a]
    opt_b = make(b)
    opt_b.load_state_dict(sd)
    for s in range(3, 5):
        for pa, pb, g in zip(a, b, grads[s]):
            pa.grad, pb.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)
    for sa, sb in zip(opt_a.state_dict()["state"].values(), opt_b.state_dict()["state"].values()):
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
    with pytest.raises(ValueError, match="has shape"):
        rfsdp.optim.AdamW8bit([nn.Parameter(torch.zeros(3, 5))]).load_state_dict(
            rfsdp.optim.AdamW8bit([nn.Parameter(torch.zeros(3, 4))]).state_dict() |
            {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3, 4),
                           "exp_avg_sq": torch.zeros(3, 4)}}})


def test_8bit_defaults_are_stated_once():
    """AdamW8bit's and policy.blockwise_8bit's block and min_8bit_size default to
    the C++ AdamW8bitConfig's (256, 4096): the policy plans the blocks the
    optimizer keeps, with no number written twice."""
    p = torch.nn.Parameter(torch.randn(48, 40))
    opt = rfsdp.optim.AdamW8bit([p])
    assert opt.config.settings() == {"block": 256, "min_8bit_size": 4096}
    pol, explicit = rfsdp.policy.blockwise_8bit(), rfsdp.policy.blockwise_8bit(256)
    for shape in [(48, 40), (7, 3), (1000,), (5, 6, 7)]:
        t = torch.empty(shape)
        assert pol.granule("w", t) == explicit.granule("w", t)
    assert rfsdp.policy.blockwise_8bit().granule("w", torch.empty(48, 40)) \
        != rfsdp.policy.blockwise_8bit(128).granule("w", torch.empty(48, 40))
