"""rfsdp.optim.Shampoo from Python: a model with a matrix larger than the
preconditioner dim both ways, one not a multiple of it, an expert stack whose H
is not a multiple, and biases, fully sharded with policy.shampoo on 2 ranks
(processes, Gloo), equals the same optimizer on the unsharded model; groups
with use_shampoo=False are AdamW; the state_dict round trip; bad settings."""
import math
import os
import sys

import pytest
import torch
from torch import nn

import rfsdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from slice_training import assert_trains_like, train_on_slices, train_reference  # noqa: E402
from ranks import run_ranks  # noqa: E402

B, STEPS, WORLD = 8, 12, 2


class Experts(nn.Module):
    def __init__(self, d, e=3, h=10):
        super().__init__()
        self.w = nn.Parameter(torch.randn(e, h, d) / math.sqrt(d))  # H = 10: not a multiple of B

    def forward(self, x):
        return torch.einsum("bd,ehd->bh", x, self.w) / self.w.shape[0]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.big = nn.Linear(19, 20)     # 20 x 19: larger than B both ways
        self.odd = nn.Linear(20, 13)     # 13 x 20: rows not a multiple of B
        self.experts = Experts(13)
        self.head = nn.Linear(10, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.experts(torch.tanh(self.odd(torch.tanh(self.big(x)))))))


def make(model):
    matrices = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith("head")]
    ids = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return rfsdp.optim.Shampoo([dict(params=matrices), dict(params=rest, use_shampoo=False, lr=3e-3)],
                               lr=1e-2, betas=(0.9, 0.95), epsilon=1e-6, weight_decay=0.01,
                               max_preconditioner_dim=B, precondition_frequency=3,
                               start_preconditioning_step=3)


def data(seed):
    g = torch.Generator().manual_seed(seed + 3)
    return torch.randn(STEPS, 8, 19, generator=g), torch.randn(STEPS, 8, 3, generator=g)




def worker(rank, world, seed):
    torch.manual_seed(seed)
    model = Net()
    rfsdp.fully_shard(model, policy=rfsdp.policy.shampoo(B))
    opt = make(model)
    losses = train_on_slices(model, opt, *data(seed), rank, WORLD)
    return {"losses": losses, "params": rfsdp.full_parameters(model)}


def test_two_ranks_equal_the_unsharded_model():
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    torch.manual_seed(seed)
    ref = Net()
    ref_losses = train_reference(ref, make(ref), *data(seed))
    got = run_ranks(worker, WORLD, seed)[0]
    assert got["losses"] == pytest.approx(ref_losses, rel=1e-4, abs=1e-6), "seed %d" % seed
    assert_trains_like({n: p.detach() for n, p in ref.named_parameters()}, got["params"], 1e-4,
                       1e-5, "seed %d" % seed)


def test_plain_tensors_groups_and_state_dict_round_trip():
    torch.manual_seed(0)
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())
    opt_a = make(a)
    xs, ys = data(0)
    for s in range(4):
        opt_a.zero_grad()
        nn.functional.mse_loss(a(xs[s]), ys[s]).backward()
        opt_a.step()
    sd = opt_a.state_dict()
    st = sd["state"][0]  # big.weight: 20 x 19 in 3 x 3 tiles of at most 8
    # packed upper triangles: 8 x 8 -> 36, 4 x 4 -> 10 elements
    assert st["factor_left"].numel() == 2 * (36 * 3) + 10 * 3 and st["root_failures"].numel() == 9
    assert "factor_left" not in sd["state"][len(sd["state"]) - 1]  # head.bias: grafting only
    b.load_state_dict(a.state_dict())
    opt_b = make(b)
    opt_b.load_state_dict(sd)
    for s in range(4, 8):  # preconditioned steps, roots recomputed at 6
        for m, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            nn.functional.mse_loss(m(xs[s]), ys[s]).backward()
            opt.step()
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n


def test_lr_scheduler_and_grafting_before_preconditioning_equal_torch_adamw():
    # Before start_preconditioning_step the direction is Adam's (grafting settings), so
    # Shampoo under a scheduler equals torch.optim.AdamW under the same scheduler.
    torch.manual_seed(int(torch.randint(0, 2 ** 30, ()).item()))
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())
    ours = rfsdp.optim.Shampoo(a.parameters(), lr=1e-2, betas=(0.9, 0.999), grafting_beta2=0.95,
                               grafting_epsilon=1e-6, weight_decay=0.1, max_preconditioner_dim=B,
                               precondition_frequency=5, start_preconditioning_step=100)
    ref = torch.optim.AdamW(b.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (ours, ref)]
    xs, ys = data(1)
    for s in range(8):
        for m, opt in ((a, ours), (b, ref)):
            opt.zero_grad()
            nn.functional.mse_loss(m(xs[s]), ys[s]).backward()
            opt.step()
        for sc in scheds:
            sc.step()
    assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == 1e-2 / 16
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: "%s: %s" % (n, m))


def test_bad_settings_are_clear_errors():
    p = [nn.Parameter(torch.zeros(4, 4))]
    with pytest.raises(ValueError, match="start_preconditioning_step .* >= precondition_frequency"):
        rfsdp.optim.Shampoo(p, precondition_frequency=10, start_preconditioning_step=5)
    with pytest.raises(ValueError, match="max_preconditioner_dim must be a positive integer"):
        rfsdp.optim.Shampoo(p, max_preconditioner_dim=0)
    with pytest.raises(ValueError, match="factor_dtype"):
        rfsdp.optim.Shampoo(p, factor_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"Shampoo: betas\[0\] must be in \[0, 1\), got 1$"):
        rfsdp.optim.Shampoo(p, betas=(1.0, 0.9))


def test_shard_that_cuts_a_tile_is_refused(one_rank):
    cut = nn.Parameter(torch.zeros(12, 19))  # rows 4..16 of a 20 x 19 matrix, tiles of 8 rows
    cut._rfsdp_shard = rfsdp.ShardInfo("w", (20, 19), 1, 4, 16)
    with pytest.raises(ValueError, match="parameter 'w'.*rfsdp.policy.shampoo"):
        rfsdp.optim.Shampoo([cut], max_preconditioner_dim=8)
