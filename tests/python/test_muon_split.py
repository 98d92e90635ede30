"""Muon per logical block (a group's split_sizes): every block of a fused
parameter is its own matrix, on 1-3 ranks, with the plan keeping blocks whole
(rfsdp.policy.muon(split=...): the step moves nothing), without it and on
torch's FSDP2 (cut blocks go to a root and back), against a float64 single-device Muon that
splits by hand (tests/python/muon_reference.py)."""
import os
import sys

import pytest
import torch
from torch import nn

import rfsdp

sys.path.insert(0, os.path.dirname(__file__))
from muon_reference import ReferenceMuon  # noqa: E402
from ranks import run_ranks  # noqa: E402

# name: (shape, split_sizes): a grouped-query fused QKV (q 4 heads, k and v 1 head
# of 8), per-head blocks, and an expert stack whose experts split unequally.
BLOCKS = {"qkv": ((48, 16), (32, 8, 8)),
          "heads": ((32, 16), (8, 8, 8, 8)),
          "experts": ((2, 12, 16), (4, 8))}
STEPS = 3
HYPER = dict(lr=0.02, momentum=0.95, weight_decay=0.01)


class Blocks(nn.Module):
    """The parameters of BLOCKS and a bias; loss = sum(p * G_t): each step's
    gradient is G_t exactly, on every rank."""

    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        for name, (shape, _) in BLOCKS.items():
            setattr(self, name, nn.Parameter(torch.randn(shape, generator=g)))
        self.bias = nn.Parameter(torch.randn(16, generator=g))

    def forward(self, grads):
        return sum((p * grads[n]).sum() for n, p in self.named_parameters())


def gradients(seed, model):
    g = torch.Generator().manual_seed(seed + 1)
    return [{n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
            for _ in range(STEPS)]


def run(seed, policy, steps=STEPS, mesh=None, group_split=True, **muon):
    """Muon (split by group; muon: more settings) over a fully_shard model planned
    by `policy` (mesh: HSDP's; group_split=False: the groups give no split_sizes,
    Muon takes the plan's blocks): its full parameters after `steps` steps, the
    elements this rank sends per step and the number of matrices."""
    model = Blocks(seed)
    full_shapes = {n: p.shape for n, p in model.named_parameters()}
    grads = gradients(seed, model)[:steps]
    rfsdp.fully_shard(model, policy=policy, mesh=mesh)
    named = dict(model.named_parameters())
    groups = [dict(params=[named[n]], split_sizes=list(split) if group_split else None)
              for n, (_, split) in BLOCKS.items()]
    groups.append(dict(params=[named["bias"]], use_muon=False))
    opt = rfsdp.optim.Muon(groups, **HYPER, **muon)
    for g in grads:
        model(g).backward()
        opt.step()
        opt.zero_grad()
    full = rfsdp.full_parameters(model)
    assert {n: tuple(t.shape) for n, t in full.items()} == {n: tuple(s) for n, s in full_shapes.items()}
    return full, opt._impl.gather_send_elems(), len(opt._impl.matrices())


def run_fsdp2(seed, world):
    """The same on torch's FSDP2 (chunk rows, which cut blocks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = Blocks(seed)
    grads = gradients(seed, model)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    named = dict(model.named_parameters())
    groups = [dict(params=[named[n]], split_sizes=list(split)) for n, (_, split) in BLOCKS.items()]
    groups.append(dict(params=[named["bias"]], use_muon=False))
    opt = rfsdp.optim.Muon(groups, **HYPER)
    for g in grads:
        model(g).backward()
        opt.step()
        opt.zero_grad()
    return ({n: p.full_tensor() for n, p in model.named_parameters()},
            opt._impl.gather_send_elems(), len(opt._impl.matrices()))


def worker(rank, world, seed):
    split = {n: list(s) for n, (_, s) in BLOCKS.items()}
    return {"kept": run(seed, rfsdp.policy.muon(split=split)),
            "plan": run(seed, rfsdp.policy.muon(split=split), group_split=False),
            "cut": run(seed, rfsdp.policy.muon()),
            "fsdp2": run_fsdp2(seed, world)}


def reference(seed, split=True, steps=STEPS, momentum_dtype=None):
    model = Blocks(seed)
    ref = ReferenceMuon({n: p.detach().double().clone() for n, p in model.named_parameters()},
                        list(BLOCKS), splits={n: s for n, (_, s) in BLOCKS.items()} if split else {},
                        momentum_dtype=momentum_dtype, **HYPER)
    for g in gradients(seed, model)[:steps]:
        ref.step(g)
    return ref.p


def worker_hsdp_and_8bit(rank, world, seed):
    """HSDP (2 replicas of 2 shards) with the split policy; and 8-bit momentum
    (blocks of 64, whole on every shard) with it, one step: its update comes from
    the fp32 momentum before it is encoded, so it is the fp32 one's; and bfloat16
    momentum, every step."""
    from torch.distributed.device_mesh import init_device_mesh
    split = rfsdp.policy.muon(split={n: list(s) for n, (_, s) in BLOCKS.items()})
    return {"hsdp": run(seed, split, mesh=init_device_mesh("cpu", (2, 2))),
            "int8": run(seed, rfsdp.policy.combine(split, rfsdp.policy.blockwise_8bit(64)), steps=1,
                        momentum_dtype="int8", momentum_block=64),
            "bf16": run(seed, split, momentum_dtype=torch.bfloat16)}


def test_split_blocks_under_hsdp_and_with_8bit_and_bf16_momentum_equal_the_float64_muon():
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    got = run_ranks(worker_hsdp_and_8bit, 4, seed)
    for case, steps in (("hsdp", STEPS), ("int8", 1), ("bf16", STEPS)):
        want = reference(seed, steps=steps,
                         momentum_dtype=torch.bfloat16 if case == "bf16" else None)
        for rank in range(4):
            params, sent, _ = got[rank][case]
            assert sent == 0, (case, rank)
            for n, w in want.items():
                torch.testing.assert_close(params[n].double(), w, rtol=1e-4, atol=1e-5,
                                           msg=lambda m: "%s %s rank %d (seed %d): %s"
                                           % (case, n, rank, seed, m))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_split_blocks_equal_the_float64_muon_that_splits_by_hand(world):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    got = run_ranks(worker, world, seed)
    want, unsplit = reference(seed), reference(seed, split=False)
    blocks = sum(len(s) * (shape[0] if len(shape) == 3 else 1) for shape, s in BLOCKS.values())
    for case in ("kept", "plan", "cut", "fsdp2"):
        for rank in range(world):
            params, sent, matrices = got[rank][case]
            assert matrices == blocks, (case, matrices)
            for n, w in want.items():
                torch.testing.assert_close(params[n].double(), w, rtol=1e-4, atol=1e-5,
                                           msg=lambda m: "%s %s rank %d of %d (seed %d): %s"
                                           % (case, n, rank, world, seed, m))
    # The plan that keeps blocks whole moves nothing; the plain one cuts some.
    assert all(r["kept"][1] == 0 and r["plan"][1] == 0 for r in got)
    if world > 1:
        assert sum(r["cut"][1] for r in got) > 0 and sum(r["fsdp2"][1] for r in got) > 0
    # (The test can fail: orthogonalising whole matrices is far from splitting them.)
    assert max((want[n] - unsplit[n]).abs().max().item() for n in BLOCKS) > 1e-2


def test_a_wrong_split_is_an_error_naming_the_parameter():
    w = nn.Parameter(torch.randn(12, 4))
    with pytest.raises(ValueError, match="'param 0'.*sum to 10 rows, its matrix has 12"):
        rfsdp.optim.Muon([dict(params=[w], split_sizes=[4, 6])])
    with pytest.raises(ValueError, match="must be positive row counts"):
        rfsdp.optim.Muon([dict(params=[w], split_sizes=[12, 0])])
    e = nn.Parameter(torch.randn(2, 6, 4))  # a stack splits each expert's rows
    rfsdp.optim.Muon([dict(params=[e], split_sizes=[2, 4])])
    with pytest.raises(ValueError, match="sum to 12 rows, its experts have 6"):
        rfsdp.optim.Muon([dict(params=[e], split_sizes=[4, 8])])


def test_a_state_dict_with_another_split_is_refused_and_a_changed_split_is_followed():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(12, 4))
    a = rfsdp.optim.Muon([dict(params=[w], split_sizes=[4, 8])])
    w.grad = torch.randn(12, 4)
    a.step()
    b = rfsdp.optim.Muon([dict(params=[w], split_sizes=[6, 6])])
    with pytest.raises(ValueError, match="split_sizes=\\[4, 8\\], this optimizer has \\[6, 6\\]"):
        b.load_state_dict(a.state_dict())
    a.param_groups[0]["split_sizes"] = [6, 6]  # followed at the next step: the layout is rebuilt
    a.step()
    assert [m["rows"] for m in a._impl.matrices()] == [6, 6]


def test_the_plan_carries_the_blocks_and_a_group_that_disagrees_is_an_error(one_rank):
    model = Blocks(0)
    split = {n: list(s) for n, (_, s) in BLOCKS.items()}
    rfsdp.fully_shard(model, policy=rfsdp.policy.muon(split=split))
    named = dict(model.named_parameters())
    for n, s in split.items():
        assert list(rfsdp.fsdp.dtensor.info_of(n, named[n]).shard.blocks) == s, n
    assert list(rfsdp.fsdp.dtensor.info_of("bias", named["bias"]).shard.blocks) == []
    with pytest.raises(ValueError, match="'qkv': its group's split_sizes \\[16, 16, 16\\] \\(split_dim "
                                         "0\\) differ from the logical blocks its plan keeps "
                                         "whole, \\[32, 8, 8\\]"):
        rfsdp.optim.Muon([dict(params=[named["qkv"]], split_sizes=[16, 16, 16])])
    # Policies that give one parameter different blocks do not combine.
    a = rfsdp.policy.muon(split={"w": [4, 4]})
    b = rfsdp.policy.muon(split={"w": [2, 6]})
    with pytest.raises(ValueError, match="different logical blocks"):
        rfsdp.policy.combine(a, b).blocks("w", torch.zeros(8, 3))


def test_a_granule_that_would_cut_a_block_is_refused_by_the_planner():
    # (the blocks' own granule is 8 rows; 4 would put a boundary inside a block)
    with pytest.raises(ValueError, match="inside one of its logical blocks; use 8"):
        rfsdp._C.plan_specs([("w", [16, 4], 4, 1, 4, [8, 8], 0)], 2)
    assert rfsdp._C.block_granule_rows("w", [48, 16], 1, [32, 8, 8]) == "whole"
    assert rfsdp._C.block_granule_rows("e", [2, 12, 16], 2, [4, 8]) == 12
    assert rfsdp._C.block_granule_rows("h", [32, 16], 1, [8] * 4) == 8
    rfsdp._C.plan_specs([("w", [16, 4], 16, 1, 4, [8, 8], 0), ("v", [16, 4], 8, 1, 4, [8, 8], 0)], 2)


def test_a_checkpoint_saved_with_another_split_is_refused_naming_both(one_rank, tmp_path):
    import rfsdp.checkpoint as ckpt
    torch.manual_seed(0)

    def built(split):
        model = nn.Linear(4, 12, bias=False)
        rfsdp.fully_shard(model)
        opt = rfsdp.optim.Muon([dict(params=list(model.parameters()), split_sizes=split)])
        return model, opt
    model, opt = built([4, 8])
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    ckpt.save(str(tmp_path / "c"), model, opt)
    again, opt2 = built([6, 6])
    with pytest.raises(ckpt.CheckpointError, match="split_sizes=\\[4, 8\\], this optimizer has \\[6, 6\\]"):
        ckpt.load(str(tmp_path / "c"), again, opt2)
    same, opt3 = built([4, 8])
    ckpt.load(str(tmp_path / "c"), same, opt3)  # the same split loads
    assert torch.equal(rfsdp.full_parameters(same)["weight"], rfsdp.full_parameters(model)["weight"])
