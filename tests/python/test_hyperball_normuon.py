"""Hyperball (MuonH, AdamH: a group's hyperball=True) and NorMuon against a
float64 single-device reference written from their definitions (below), in one
process, on 2 and 3 ranks of rfsdp.fully_shard (and HSDP, 2 x 2) with matrices and blocks cut
across ranks (their norms summed in one all-reduce), on torch's FSDP2 (Shard(0)
chunks) and with replicated (DDP) parameters; bf16 parameters; Hyperball keeping
every matrix's norm over many steps; the radius and NorMuon's v through
state_dict and rfsdp.checkpoint (2 ranks -> 1); weight decay with Hyperball refused."""
import copy
import math
import os
import sys
import tempfile

import pytest
import torch
from torch import nn

import rfsdp
import rfsdp.checkpoint as ckpt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from muon_reference import matrices, orthogonalise  # noqa: E402
from ranks import run_ranks  # noqa: E402

# name: shape (w more than half of them: every plan cuts it); SPLITS: the groups' split_sizes and split_dim: a grouped-query
# fused QKV (row blocks) and a Conv1D-style [in, 3 in] (column blocks).
SHAPES = {"w": (160, 16), "qkv": (48, 16), "experts": (2, 12, 16), "conv": (16, 48),
          "bias": (16,)}
SPLITS = {"qkv": ((32, 8, 8), 0), "conv": ((16, 16, 16), 1)}
STEPS = 3
MUON = dict(lr=0.02, momentum=0.95)
AUX = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-10)
ADAM = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
KINDS = ["muonh", "normuon", "normuonh", "adamh"]


class Grads(nn.Module):
    """The parameters of SHAPES; loss = sum(p * G_t): each step's gradient is G_t
    exactly, on every rank."""

    def __init__(self, seed, dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        for name, shape in SHAPES.items():
            setattr(self, name, nn.Parameter(torch.randn(shape, generator=g).to(dtype)))

    def forward(self, grads):
        return sum((p * grads[n].to(p.dtype)).sum() for n, p in self.named_parameters())


def gradients(seed, steps):
    g = torch.Generator().manual_seed(seed + 1)
    return [{n: torch.randn(s, generator=g) for n, s in SHAPES.items()} for _ in range(steps)]


def optimizer(kind, named, radius=None):
    """kind's optimizer over the named parameters: Muon's groups split as SPLITS
    says, the bias in AdamW's part."""
    if kind.startswith("adam"):
        cls = rfsdp.optim.AdamW8bit if kind == "adamh8" else rfsdp.optim.AdamW
        extra = dict(block=64, min_8bit_size=64) if kind == "adamh8" else {}
        return cls(list(named.values()), weight_decay=0.0, hyperball=True,
                   hyperball_radius=radius, **ADAM, **extra)
    hyper = kind.endswith("h")
    groups = [dict(params=[named[n]], split_sizes=list(SPLITS[n][0]) if n in SPLITS else None,
                   split_dim=SPLITS[n][1] if n in SPLITS else 0)
              for n in SHAPES if n != "bias"]
    groups.append(dict(params=[named["bias"]], use_muon=False, **AUX))
    cls = rfsdp.optim.NorMuon if kind.startswith("normuon") else rfsdp.optim.Muon
    return cls(groups, weight_decay=0.0 if hyper else 0.01, hyperball=hyper,
               hyperball_radius=radius, **MUON)


class Reference:
    """float64, whole tensors, from the definitions: Muon's momentum (Nesterov)
    and Newton–Schulz per block, O = scale * NS (adjust_lr "original":
    max(1, rows/cols)^0.5); NorMuon per block: v <- lerp(v, mean(O^2, cols),
    1 - beta2), N = O / (sqrt(v) + eps), N *= |O| / max(|N|, 1e-8); AdamW's
    d = m^ / (sqrt(v^) + eps); Hyperball per parameter: u = d / (|d| + 1e-8),
    W <- W - lr R u, W <- R W / (|W| + 1e-8), R the norm at the first step."""

    def __init__(self, params, kind, radius=None):
        self.p, self.kind, self.radius = params, kind, radius
        self.hyper = kind.endswith("h")
        self.m = {n: torch.zeros_like(t) for n, t in params.items()}
        self.v = {n: torch.zeros_like(t) for n, t in params.items()}
        self.rows = {}  # NorMuon's v: (name, block) -> per-row
        self.R = {}
        self.t = 0

    def ball(self, n, w, d, lr):
        if n not in self.R:
            self.R[n] = self.radius if self.radius is not None else w.norm().item()
        r = self.R[n]
        w.sub_(lr * r * d / (d.norm() + 1e-8))
        w.mul_(r / (w.norm() + 1e-8))

    def step(self, grads):
        self.t += 1
        for n, w in self.p.items():
            g = grads[n].double()
            if self.kind.startswith("adam") or n == "bias":
                h = ADAM if self.kind.startswith("adam") else AUX
                b1, b2 = h["betas"]
                self.m[n] = b1 * self.m[n] + (1 - b1) * g
                self.v[n] = b2 * self.v[n] + (1 - b2) * g * g
                d = (self.m[n] / (1 - b1 ** self.t)) / ((self.v[n] / (1 - b2 ** self.t)).sqrt() + h["eps"])
                if self.hyper and w.dim() >= 2 and self.kind.startswith("adam"):
                    self.ball(n, w, d, h["lr"])
                else:
                    w.sub_(h["lr"] * d)
                continue
            beta = MUON["momentum"]
            self.m[n] = beta * self.m[n] + (1 - beta) * g
            u = (1 - beta) * g + beta * self.m[n]
            split, dim = SPLITS.get(n, (None, 0))
            d = torch.zeros_like(w)
            for b, (ub, db) in enumerate(zip(matrices(u, split, dim), matrices(d, split, dim))):
                r, c = ub.shape
                o = math.sqrt(max(1.0, r / c)) * orthogonalise(ub)
                if self.kind.startswith("normuon"):
                    v = self.rows.get((n, b), torch.zeros(r, dtype=torch.float64))
                    v = v + (1 - 0.95) * ((o * o).mean(1) - v)
                    self.rows[(n, b)] = v
                    nrm = o / (v.sqrt() + 1e-8)[:, None]
                    o = nrm * o.norm() / max(nrm.norm().item(), 1e-8)
                db.copy_(o)
            if self.hyper:
                self.ball(n, w, d, MUON["lr"])
            else:
                w.mul_(1 - MUON["lr"] * 0.01).sub_(MUON["lr"] * d)


def reference(seed, kind, steps=STEPS, radius=None, dtype=torch.float32):
    model = Grads(seed, dtype)
    ref = Reference({n: p.detach().double().clone() for n, p in model.named_parameters()}, kind, radius)
    for g in gradients(seed, steps):
        ref.step({n: t.to(dtype) for n, t in g.items()})
    return ref.p


def train(model, opt, grads):
    for g in grads:
        model(g).backward()
        opt.step()
        opt.zero_grad()


def sent(opt):
    return opt.hyperball_bytes() if isinstance(opt, rfsdp.optim.AdamW) else opt.normalise_bytes()


def assert_matches(got, want, what, rtol=1e-4, atol=1e-5):
    for n, w in want.items():
        torch.testing.assert_close(got[n].double(), w, rtol=rtol, atol=atol,
                                   msg=lambda m: "%s %s: %s" % (what, n, m))


@pytest.mark.parametrize("kind", KINDS)
def test_one_process_equals_the_float64_reference(kind):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    model = Grads(seed)
    opt = optimizer(kind, dict(model.named_parameters()))
    train(model, opt, gradients(seed, STEPS))
    assert sent(opt) == 0
    want = reference(seed, kind)
    assert_matches(dict(model.named_parameters()), want, "%s (seed %d)" % (kind, seed))
    # (the test can fail: the plain update is far from these)
    plain = reference(seed, "muon" if not kind.startswith("adam") else "adam")
    assert max((plain[n] - want[n]).abs().max().item() for n in SHAPES) > 1e-3


def sharded_worker(rank, world, seed):
    """Every kind on fully_shard with a plan that cuts matrices and blocks
    (granule 1; on 4 ranks HSDP, 2 replicas of 2), on FSDP2's chunks (2 ranks),
    and replicated (DDP: plain parameters on every rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    out = {}
    grads = gradients(seed, STEPS)
    for kind in KINDS:
        model = Grads(seed)
        # (4 ranks: HSDP, 2 replicas of 2 shards: the norms' sums over each replica's
        # shard group; the replicas step alike)
        rfsdp.fully_shard(model, policy=rfsdp.policy.muon(),
                          mesh=init_device_mesh("cpu", (2, 2)) if world == 4 else None)
        opt = optimizer(kind, dict(model.named_parameters()))
        train(model, opt, grads)
        out[("cut", kind)] = (rfsdp.full_parameters(model), sent(opt))
        if world != 2:
            continue
        model = Grads(seed)
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        opt = optimizer(kind, dict(model.named_parameters()))
        train(model, opt, grads)
        out[("fsdp2", kind)] = ({n: p.full_tensor() for n, p in model.named_parameters()}, sent(opt))
        model = Grads(seed)
        opt = optimizer(kind, dict(model.named_parameters()))
        train(model, opt, grads)
        out[("ddp", kind)] = ({n: p.detach().clone() for n, p in model.named_parameters()}, sent(opt))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_cut_matrices_on_ranks_equal_the_float64_reference(world):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    got = run_ranks(sharded_worker, world, seed)
    for kind in KINDS:
        want = reference(seed, kind)
        for case in ("cut", "fsdp2", "ddp") if world == 2 else ("cut",):
            for rank in range(world):
                params, _ = got[rank][(case, kind)]
                assert_matches(params, want, "%s %s rank %d of %d (seed %d)"
                               % (case, kind, rank, world, seed))
            total = sum(r[(case, kind)][1] for r in got)
            # cut parameters' sums travel (one all-reduce); replicated ones need none
            assert (total == 0) == (case == "ddp"), (case, kind, total)


def test_bf16_parameters_follow_the_reference_to_bf16_rounding():
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    for kind in KINDS:
        model = Grads(seed, torch.bfloat16)
        opt = optimizer(kind, dict(model.named_parameters()))
        train(model, opt, gradients(seed, STEPS))
        params = dict(model.named_parameters())
        assert all(p.dtype == torch.bfloat16 for p in params.values())
        assert_matches(params, reference(seed, kind, dtype=torch.bfloat16),
                       "bf16 %s (seed %d)" % (kind, seed), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("kind", ["muonh", "normuonh", "adamh", "adamh8"])
def test_hyperball_keeps_every_matrix_norm_over_many_steps(kind):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    model = Grads(seed)
    named = dict(model.named_parameters())
    start = {n: p.detach().double().norm().item() for n, p in named.items()}
    opt = optimizer(kind, named)
    for g in gradients(seed, 50):
        model(g).backward()
        opt.step()
        opt.zero_grad()
        for n, p in named.items():
            if p.dim() >= 2:  # fp32 rounding of the elements, not of the step
                assert abs(p.detach().double().norm().item() - start[n]) <= 2e-6 * start[n], \
                    (kind, n, seed)
                assert opt.state[p]["hyperball_radius"].item() == pytest.approx(start[n], rel=1e-7)
    assert (named["bias"].detach().double().norm().item() - start["bias"]) != 0


def test_a_given_radius_is_the_norm_from_the_first_step():
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    for kind in ("muonh", "adamh"):
        model = Grads(seed)
        opt = optimizer(kind, dict(model.named_parameters()), radius=3.0)
        train(model, opt, gradients(seed, STEPS))
        assert_matches(dict(model.named_parameters()), reference(seed, kind, radius=3.0),
                       "%s radius 3 (seed %d)" % (kind, seed))
        assert abs(model.w.detach().double().norm().item() - 3.0) < 1e-5


def expect_resumed_exactly(kind, seed, model, opt, saved_params, saved, rest):
    """model and opt trained on through `rest` equal a fresh model and kind's
    optimizer given saved_params and the state_dict `saved`, trained on the same."""
    train(model, opt, rest)
    again = Grads(seed)
    with torch.no_grad():
        for n, p in again.named_parameters():
            p.copy_(saved_params[n])
    opt2 = optimizer(kind, dict(again.named_parameters()))
    opt2.load_state_dict(saved)
    train(again, opt2, rest)
    for (n, a), b in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(a, b), (kind, n, seed)


@pytest.mark.parametrize("kind", ["normuonh", "adamh"])
def test_state_dict_round_trip_continues_exactly(kind):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    grads = gradients(seed, 2 * STEPS)
    model = Grads(seed)
    opt = optimizer(kind, dict(model.named_parameters()))
    train(model, opt, grads[:STEPS])
    saved_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    saved = copy.deepcopy(opt.state_dict())  # (its tensors are the optimizer's own)
    names = set(saved["state"][0])
    assert "hyperball_radius" in names and (kind != "normuonh" or "normuon_v" in set(saved["state"][1]))
    expect_resumed_exactly(kind, seed, model, opt, saved_params, saved, grads[STEPS:])


@pytest.mark.parametrize("kind", ["muonh", "adamh"])
def test_hyperball_turned_on_mid_run_is_saved_and_resumes_exactly(kind):
    # Built without Hyperball (weight decay 0), turned on after STEPS steps (as a
    # schedule may): the radius it then keeps is in opt.state and state_dict, and a
    # resume from that state_dict continues as the uninterrupted run.
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    grads = gradients(seed, 3 * STEPS)
    model = Grads(seed)
    opt = optimizer(kind, dict(model.named_parameters()))
    for g in opt.param_groups:
        g["hyperball"] = False
    train(model, opt, grads[:STEPS])
    for g in opt.param_groups:
        g["hyperball"] = g.get("use_muon") is not False
    train(model, opt, grads[STEPS:2 * STEPS])
    assert "hyperball_radius" in opt.state[model.w]
    saved_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    saved = copy.deepcopy(opt.state_dict())
    assert "hyperball_radius" in saved["state"][0], sorted(saved["state"][0])
    expect_resumed_exactly(kind, seed, model, opt, saved_params, saved, grads[2 * STEPS:])


def test_a_state_saved_without_hyperball_loads_as_saved_then_hyperball_turns_on():
    # The load restores the saved groups' options (torch's rule): an optimizer built
    # with Hyperball refuses the radius-less state naming the way; built as saved,
    # it loads, and Hyperball turned on after the load keeps |W| from then on.
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    grads = gradients(seed, 2 * STEPS)
    model = Grads(seed)
    opt = optimizer("muonh", dict(model.named_parameters()))
    for g in opt.param_groups:
        g["hyperball"] = False
    train(model, opt, grads[:STEPS])
    saved = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="lacks 'hyperball_radius'.*change them after the load"):
        optimizer("muonh", dict(model.named_parameters())).load_state_dict(saved)
    opt2 = optimizer("muon", dict(model.named_parameters()))  # (weight decay: the saved 0)
    opt2.load_state_dict(saved)
    for g in opt2.param_groups:
        g["hyperball"] = g.get("use_muon") is not False
    norm = model.w.detach().norm().item()
    train(model, opt2, grads[STEPS:])
    assert model.w.detach().norm().item() == pytest.approx(norm, rel=1e-5), seed
    assert opt2.state[model.w]["hyperball_radius"].item() == pytest.approx(norm, rel=1e-6)


def int8_worker(rank, world, seed):
    """NorMuonH with 8-bit momentum (blocks of 64, whole on every shard)."""
    model = Grads(seed)
    if world > 1:
        rfsdp.fully_shard(model, policy=rfsdp.policy.combine(rfsdp.policy.muon(),
                                                             rfsdp.policy.blockwise_8bit(64)))
    named = dict(model.named_parameters())
    groups = [dict(params=[named[n]], split_sizes=list(SPLITS[n][0]) if n in SPLITS else None,
                   split_dim=SPLITS[n][1] if n in SPLITS else 0) for n in SHAPES if n != "bias"]
    groups.append(dict(params=[named["bias"]], use_muon=False, **AUX))
    opt = rfsdp.optim.NorMuon(groups, weight_decay=0.0, hyperball=True, momentum_dtype="int8",
                              momentum_block=64, **MUON)
    train(model, opt, gradients(seed, STEPS))
    st = opt.state[named["w"]]
    return (rfsdp.full_parameters(model) if world > 1 else
            {n: p.detach().clone() for n, p in named.items()},
            sorted(st), st["normuon_v"].dtype, opt.normalise_bytes())


def test_normuon_with_8bit_momentum_on_two_ranks_equals_one_process():
    """The momentum's codes do not depend on the world size, v is fp32 beside them;
    the norms summed across ranks in another order differ by rounding only."""
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    one = run_ranks(int8_worker, 1, seed)[0]
    two = run_ranks(int8_worker, 2, seed)
    assert one[1] == ["hyperball_radius", "momentum_absmax", "momentum_codes", "normuon_v"]
    assert one[2] == torch.float32 and sum(r[3] for r in two) > 0
    for rank, got in enumerate(two):
        assert got[1] == one[1]
        assert_matches(got[0], {n: t.double() for n, t in one[0].items()},
                       "int8 rank %d (seed %d)" % (rank, seed), rtol=1e-5, atol=1e-6)
    # (the test can fail: 8-bit momentum moves the run away from the fp32 one)
    fp32 = reference(seed, "normuonh")
    assert max((one[0][n].double() - fp32[n]).abs().max().item() for n in SHAPES) > 1e-4


def checkpoint_worker(rank, world, seed, d, phase):
    grads = gradients(seed, 2 * STEPS)
    out = {}
    for kind in ("normuonh", "adamh"):
        model = Grads(seed)
        rfsdp.fully_shard(model, policy=rfsdp.policy.muon())
        opt = optimizer(kind, dict(model.named_parameters()))
        path = os.path.join(d, kind)
        if phase == "train":
            train(model, opt, grads[:STEPS])
            ckpt.save(path, model, opt)
            train(model, opt, grads[STEPS:])
        else:
            ckpt.load(path, model, opt)
            train(model, opt, grads[STEPS:])
        out[kind] = rfsdp.full_parameters(model)
    return out


def test_checkpoint_reshards_two_ranks_to_one_and_continues():
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    with tempfile.TemporaryDirectory() as d:
        trained = run_ranks(checkpoint_worker, 2, seed, d, "train")[0]
        resumed = run_ranks(checkpoint_worker, 1, seed, d, "resume")[0]
    for kind, want in trained.items():
        for n, t in want.items():
            torch.testing.assert_close(resumed[kind][n], t, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: "%s %s (seed %d): %s" % (kind, n, seed, m))
        # (the test can fail: the full run is far from the radius or v starting again)
        assert_matches(resumed[kind], reference(seed, kind, 2 * STEPS), kind)


def collectives_worker(rank, world, seed):
    """AdamW8bit on FSDP2's chunks (2 ranks) with blocks of 100, which every
    matrix's chunk boundary cuts (shared blocks, agreed by an all-reduce), two
    groups (w and qkv; the rest), Hyperball on the first or on none: the
    collectives of one step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    out = {}
    grads = gradients(seed, 2)
    for ball in (False, True):
        model = Grads(seed)
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        named = dict(model.named_parameters())
        opt = rfsdp.optim.AdamW8bit(
            [dict(params=[named["w"], named["qkv"]], hyperball=ball),
             dict(params=[p for n, p in named.items() if n not in ("w", "qkv")])],
            weight_decay=0.0, block=100, min_8bit_size=64, **ADAM)
        train(model, opt, grads[:1])
        before = opt.comm.stats()["collectives"]
        train(model, opt, grads[1:])
        out[ball] = opt.comm.stats()["collectives"] - before
    return out


def test_adamh8_adds_one_collective_a_step_beside_shared_blocks():
    got = run_ranks(collectives_worker, 2, 5)
    for r in got:
        assert r[True] == r[False] + 1, r


@pytest.mark.parametrize("kind", ["muonh", "normuonh", "adamh", "adamh8"])
def test_weight_decay_with_hyperball_is_refused(kind):
    model = Grads(0)
    named = dict(model.named_parameters())
    with pytest.raises(ValueError, match="hyperball=True takes no weight decay.*weight_decay"):
        if kind.startswith("adam"):
            cls = rfsdp.optim.AdamW8bit if kind == "adamh8" else rfsdp.optim.AdamW
            cls(list(named.values()), weight_decay=0.1, hyperball=True)
        else:
            cls = rfsdp.optim.NorMuon if kind.startswith("normuon") else rfsdp.optim.Muon
            cls([dict(params=[named["w"]])], weight_decay=0.1, hyperball=True)


def test_hyperball_in_a_use_muon_false_group_is_refused_and_such_groups_keep_their_decay():
    model = Grads(0)
    named = dict(model.named_parameters())
    with pytest.raises(ValueError, match="hyperball applies to Muon's matrices"):
        rfsdp.optim.Muon([dict(params=[named["w"]]),
                          dict(params=[named["bias"]], use_muon=False, hyperball=True)])
    # the optimizer's hyperball=True is its matrices': the AdamW group's decay stays
    opt = rfsdp.optim.Muon([dict(params=[named["w"]]),
                            dict(params=[named["bias"]], use_muon=False, weight_decay=0.1)],
                           hyperball=True)
    assert [g["hyperball"] for g in opt.param_groups] == [True, False]
