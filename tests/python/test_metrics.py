"""opt.metrics(): the last step's work per group counted exactly as the layout
implies (Muon's matrices and split blocks, Shampoo's and SOAP's tiles and root or
basis refreshes by their schedules), the update's RMS against the parameters'
change computed in float64, the bytes the step sent (0 in one process, > 0 on 2
ranks); and Muon's refusal of a step in which a matrix ran no Newton-Schulz
(DeepSpeed #8441's silent plain SGD), forced by a fault-injection hook, on
every rank."""
import math
import os
import sys

import pytest
import torch
from torch import nn

import rfsdp

sys.path.insert(0, os.path.dirname(__file__))
from ranks import assert_raised, raised, run_ranks  # noqa: E402

# name: shape; Muon groups: heads split in 4 blocks; the expert stack (2 x 2 blocks)
# and a plain matrix; the bias with AdamW.
SHAPES = {"heads": (32, 16), "experts": (2, 12, 16), "plain": (24, 16), "bias": (16,)}
SPLITS = {"heads": [8, 8, 8, 8], "experts": [4, 8]}


class Params(nn.Module):
    """SHAPES' parameters; loss = sum(p * G): each step's gradient is G exactly."""

    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        for n, s in SHAPES.items():
            setattr(self, n, nn.Parameter(torch.randn(s, generator=g)))

    def forward(self, grads):
        return sum((p * grads[n]).sum() for n, p in self.named_parameters())


def grads_of(seed, step):
    g = torch.Generator().manual_seed(1000 * seed + step)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def muon(model):
    named = dict(model.named_parameters())
    return rfsdp.optim.Muon([dict(params=[named["heads"]], split_sizes=SPLITS["heads"]),
                             dict(params=[named["experts"]], split_sizes=SPLITS["experts"]),
                             dict(params=[named["bias"]], use_muon=False)],
                            lr=0.02, weight_decay=0.01)


GROUPS = [["heads"], ["experts", "plain"], ["bias"]]


def full(model):
    if any(rfsdp.shard_info(p) is not None for p in model.parameters()):
        return {n: t.double() for n, t in rfsdp.full_parameters(model).items()}
    return {n: p.detach().double().clone() for n, p in model.named_parameters()}


def rms_reference(before, after, names):
    sq = sum(float((after[n] - before[n]).square().sum()) for n in names)
    return math.sqrt(sq / sum(before[n].numel() for n in names))


def run_muon(seed, shard, steps=2):
    """Muon over Params (shard: rfsdp.fully_shard it, Muon's cut policy); each
    step: (metrics, the float64 parameters before and after, the matrix count by
    group from the layout)."""
    model = Params(seed)
    if shard:
        rfsdp.fully_shard(model, policy=rfsdp.policy.muon())
    named = dict(model.named_parameters())
    groups = [dict(params=[named["heads"]], split_sizes=SPLITS["heads"]),
              dict(params=[named["experts"], named["plain"]]),
              dict(params=[named["bias"]], use_muon=False)]
    opt = rfsdp.optim.Muon(groups, lr=0.02, weight_decay=0.01)
    opt.track_update(True)
    out = []
    for t in range(steps):
        before = full(model)
        model(grads_of(seed, t)).backward()
        opt.step()
        opt.zero_grad()
        out.append((opt.metrics(), before, full(model)))
    layout = [0, 0, 0]
    group_of = {0: 0, 1: 1, 2: 1, 3: 2}
    for m in opt._impl.matrices():
        layout[group_of[m["param"]]] += 1
    return out, layout


def check_muon(results, bytes_positive):
    for metrics, before, after in results:
        assert metrics["step"] >= 1
        for k, names in enumerate(GROUPS):
            g = metrics["groups"][k]
            assert g["tiles_preconditioned"] == 0 and g["roots_refreshed"] == 0
            want = rms_reference(before, after, names)
            assert g["update_rms"] == pytest.approx(want, rel=1e-6), (k, g)
        assert (metrics["bytes_sent_total"] > 0) == bytes_positive
        assert (metrics["bytes_sent"] > 0) == bytes_positive


def test_muon_one_process_counts_rms_bytes():
    results, layout = run_muon(0, shard=False)
    # heads: 4 blocks; experts: 2 matrices (no split in this group: each expert whole) + plain
    assert layout == [4, 3, 0]
    for metrics, _, _ in results:
        assert [g["matrices_orthogonalised"] for g in metrics["groups"]] == layout
    check_muon(results, bytes_positive=False)


def muon_ranks_worker(rank, world, seed):
    return run_muon(seed, shard=True)


def test_muon_two_ranks_fully_shard_counts_rms_bytes():
    out = run_ranks(muon_ranks_worker, 2, 3)
    for results, layout in out:
        assert layout == [4, 3, 0]
        for metrics, _, _ in results:
            assert [g["matrices_orthogonalised"] for g in metrics["groups"]] == layout
        check_muon(results, bytes_positive=True)


def test_update_not_tracked_by_default_gives_no_rms():
    model = Params(1)
    opt = muon(model)
    model(grads_of(1, 0)).backward()
    opt.step()
    m = opt.metrics()
    assert [g["update_rms"] for g in m["groups"]] == [None, None, None]
    assert [g["matrices_orthogonalised"] for g in m["groups"]] == [4, 4, 0]


class Tiled(nn.Module):
    """[16, 8] (two 8 x 8 tiles), [8, 12] (8 x 8 and 8 x 4), a bias (none)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.a = nn.Parameter(torch.randn(16, 8, generator=g))
        self.b = nn.Parameter(torch.randn(8, 12, generator=g))
        self.c = nn.Parameter(torch.randn(8, generator=g))

    def forward(self):
        return sum(((p - 0.3) ** 2).sum() for p in self.parameters())


@pytest.mark.parametrize("name", ["Shampoo", "SOAP"])
def test_tiled_counts_follow_the_schedule(name):
    model = Tiled()
    f = 2
    if name == "Shampoo":
        opt = rfsdp.optim.Shampoo([dict(params=[model.a, model.b]), dict(params=[model.c])],
                                  lr=1e-2, max_preconditioner_dim=8, precondition_frequency=f,
                                  start_preconditioning_step=2)
    else:
        opt = rfsdp.optim.SOAP([dict(params=[model.a, model.b]), dict(params=[model.c])],
                               lr=1e-2, max_preconditioner_dim=8, precondition_frequency=f)
    opt.track_update(True)
    for t in range(1, 6):
        before = full(model)
        model().backward()
        opt.step()
        opt.zero_grad()
        m = opt.metrics()
        tiles = 4 if t >= 2 else 0
        roots = 4 if (t % f == 0 if name == "Shampoo" else (t == 1 or (t - 1) % f == 0)) else 0
        g0, g1 = m["groups"]
        assert (g0["tiles_preconditioned"], g0["roots_refreshed"]) == (tiles, roots), t
        assert (g1["tiles_preconditioned"], g1["roots_refreshed"], g1["matrices_orthogonalised"]) \
            == (0, 0, 0)
        after = full(model)
        assert g0["update_rms"] == pytest.approx(rms_reference(before, after, ["a", "b"]), rel=1e-6)
        assert g1["update_rms"] == pytest.approx(rms_reference(before, after, ["c"]), rel=1e-6)
        assert m["bytes_sent"] == 0 and m["step"] == t


def test_metrics_before_any_step():
    model = Tiled()
    opt = rfsdp.optim.AdamW(model.parameters(), lr=1e-2)
    m = opt.metrics()
    assert m["step"] == 0 and m["bytes_sent"] == 0
    assert m["groups"] == [dict(matrices_orthogonalised=0, tiles_preconditioned=0,
                                roots_refreshed=0, update_rms=None)]


def refusal(seed):
    """A step with 'experts' left out of Newton-Schulz: (what it raised, whether
    the parameters and the momentum stayed, what the step after raised, whether it
    stepped)."""
    model = Params(seed)
    if torch.distributed.is_initialized():
        rfsdp.fully_shard(model, policy=rfsdp.policy.muon())
    opt = muon(model)
    model(grads_of(seed, 0)).backward()
    opt.step()
    model(grads_of(seed, 1)).backward()
    state = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    before = full(model)
    opt._impl._skip_newton_schulz_for_test(1, True)
    got = raised(opt.step)
    after = full(model)
    kept = all(torch.equal(before[n], after[n]) for n in before) and all(
        torch.equal(state[n][k], opt.state[p][k]) for n, p in model.named_parameters()
        for k in state[n])
    opt._impl._skip_newton_schulz_for_test(1, False)
    again = raised(opt.step)
    return got, kept, again, not torch.equal(full(model)["experts"], after["experts"])


MESSAGE = r"no Newton-Schulz ran for a 4 x 16 matrix of Muon parameter 'param 1'.*DeepSpeed #8441"


def test_muon_refuses_a_step_without_newton_schulz_one_process():
    got, kept, again, stepped = refusal(7)
    assert_raised(got, RuntimeError, MESSAGE)
    assert kept and again is None and stepped


def refusal_worker(rank, world, seed):
    return refusal(seed)


def test_muon_refuses_a_step_without_newton_schulz_on_every_rank():
    for got, kept, again, stepped in run_ranks(refusal_worker, 2, 7):
        assert_raised(got, RuntimeError, "no Newton-Schulz ran")
        assert kept and again is None and stepped
