"""requires_grad changed after rfsdp.fully_shard is followed as torch follows it
in one process (and FSDP2 on 2 ranks): a layer frozen mid-run gets no new
gradient (with zero_grad(set_to_none=False) the optimizer steps it with the zero
gradient it holds, as torch's does), a layer frozen before sharding and unfrozen
later trains again, on 2 ranks, with the comm policies and under HSDP; a frozen
Muon matrix is not stepped (torch skips a parameter without a gradient)."""
import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import Net, data, fsdp2, optimizer  # noqa: E402
from ranks import run_ranks  # noqa: E402
from slice_training import assert_trains_like  # noqa: E402


def schedule(model, step):
    """Before step 2: freeze blocks[0]; before step 4: unfreeze it and blocks[1]
    (frozen before sharding), and freeze the head."""
    if step == 2:
        model.blocks[0].requires_grad_(False)
    if step == 4:
        model.blocks[0].requires_grad_(True)
        model.blocks[1].requires_grad_(True)
        model.head.requires_grad_(False)


def run(seed, name, shard=None, set_to_none=True, make=optimizer, comm_policy=None, mesh=None):
    import rfsdp
    torch.manual_seed(seed)
    model = Net()
    model.blocks[1].requires_grad_(False)  # frozen before sharding
    if shard == "rfsdp":
        kw = dict(comm_policy=comm_policy)
        if mesh is not None:
            from torch.distributed.device_mesh import init_device_mesh
            kw["mesh"] = init_device_mesh("cpu", mesh, mesh_dim_names=("replicate", "shard"))
        for b in model.blocks:
            rfsdp.fully_shard(b, **kw)
        rfsdp.fully_shard(model, **kw)
    elif shard == "fsdp2":
        fsdp2(model, torch.distributed.get_world_size())
    opt = make(name, model.parameters())
    xs, ys = data(seed)
    seen = []
    for step, (x, y) in enumerate(zip(xs, ys)):
        schedule(model, step)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=set_to_none)
        loss.backward()
        opt.step()
        seen.append(_full(model))
    return seen


def _full(model):
    from models import full_params
    return {n: t.detach().clone() for n, t in full_params(model).items()}


def torch_adamw(name, params):
    return torch.optim.AdamW(list(params), lr=1e-2, weight_decay=0.05)


def _ranks(rank, world, seed):
    out = {}
    for set_to_none in (True, False):
        out["AdamW", set_to_none] = run(seed, "AdamW", "rfsdp", set_to_none)
        out["Muon", set_to_none] = run(seed, "Muon", "rfsdp", set_to_none)
        out["fsdp2", set_to_none] = run(seed, "AdamW", "fsdp2", set_to_none, make=torch_adamw)
    import rfsdp
    out["bf16 gradients"] = run(seed, "AdamW", "rfsdp", comm_policy=rfsdp.CommPolicy(
        gradients="bfloat16"))
    return out


def _hsdp(rank, world, seed):
    return run(seed, "AdamW", "rfsdp", mesh=(2, 1))


@pytest.fixture(scope="module")
def results():
    seed = 7
    one = {}
    for set_to_none in (True, False):
        one["torch", set_to_none] = run(seed, "AdamW", set_to_none=set_to_none, make=torch_adamw)
        one["AdamW", set_to_none] = run(seed, "AdamW", set_to_none=set_to_none)
        one["Muon", set_to_none] = run(seed, "Muon", set_to_none=set_to_none)
    return one, run_ranks(_ranks, 2, seed, timeout=600), run_ranks(_hsdp, 2, seed, timeout=300)


def _close(a, b, what, atol=1e-6):
    """Step by step, a's parameters b's."""
    assert len(a) == len(b), what
    for step, (x, y) in enumerate(zip(a, b)):
        assert_trains_like(y, x, 0, atol, "%s, step %d" % (what, step))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_freezing_and_unfreezing_after_sharding_trains_as_one_process(results, set_to_none):
    one, ranks, _ = results
    for r, got in enumerate(ranks):
        _close(got["AdamW", set_to_none], one["AdamW", set_to_none], "rank %d" % r)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_one_process_follows_torch_adamw_and_fsdp2_too(results, set_to_none):
    """The reference's own controls: rfsdp's AdamW in one process against torch's,
    and torch's FSDP2 with torch's AdamW on 2 ranks against one process."""
    one, ranks, _ = results
    _close(one["AdamW", set_to_none], one["torch", set_to_none], "rfsdp vs torch AdamW")
    _close(ranks[0]["fsdp2", set_to_none], one["torch", set_to_none], "FSDP2", atol=1e-5)


def test_the_schedule_matters(results):
    """(So the comparisons can fail: a frozen layer stays, an unfrozen one moves.)"""
    one = results[0]["torch", True]
    for n in one[0]:
        if n.startswith("blocks.0."):
            assert torch.equal(one[1][n], one[2][n]) and torch.equal(one[2][n], one[3][n]), n
            assert not torch.equal(one[3][n], one[4][n]), n
        if n.startswith("blocks.1."):
            assert torch.equal(one[0][n], one[3][n]) and not torch.equal(one[3][n], one[4][n]), n


def test_with_bf16_gradients_and_under_hsdp(results):
    one, ranks, hsdp = results
    for r, got in enumerate(ranks):
        _close(got["bf16 gradients"], one["AdamW", True], "bf16 gradients, rank %d" % r,
               atol=5e-3)
    for r, got in enumerate(hsdp):
        _close(got, one["AdamW", True], "HSDP, rank %d" % r)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_muon_skips_a_frozen_matrix_and_two_ranks_equal_one(results, set_to_none):
    one, ranks, _ = results
    seen = one["Muon", set_to_none]
    for n in seen[0]:
        if n == "blocks.0.fc.weight" and set_to_none:  # frozen at steps 2 and 3: no gradient
            assert torch.equal(seen[1][n], seen[3][n])
    for r, got in enumerate(ranks):
        _close(got["Muon", set_to_none], seen, "Muon, rank %d" % r, atol=1e-5)
