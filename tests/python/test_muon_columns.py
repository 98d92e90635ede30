"""Muon's column blocks (a group's split_dim=1, rfsdp.policy.muon(split=...,
split_dim=1)): GPT-2's Conv1D stores c_attn.weight as [in, 3 * in], so its heads
are column blocks. Each column block is its own matrix for Newton–Schulz and
adjust_lr, against a float64 single-device Muon that splits by hand
(muon_reference.py), in one process and on 2 ranks with rfsdp.fully_shard (the
plan keeps each such matrix whole) and torch's FSDP2 (rows cut: the matrix goes to
its root)."""
import os
import sys

import pytest
import torch
from torch import nn

import rfsdp

sys.path.insert(0, os.path.dirname(__file__))
from muon_reference import ReferenceMuon  # noqa: E402
from ranks import run_ranks  # noqa: E402

# name: (shape, column counts): a fused QKV stored [in, 3 * in] (heads of 4), an
# unequal split, and an expert stack whose experts split their columns.
COLUMNS = {"c_attn": ((16, 48), [4] * 12),
           "uneven": ((12, 20), [8, 4, 8]),
           "experts": ((2, 6, 10), [4, 6])}
STEPS = 3
HYPER = dict(lr=0.02, momentum=0.95, weight_decay=0.01)


class Columns(nn.Module):
    """loss = sum(p * G_t): each step's gradient is G_t exactly, on every rank."""

    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        for name, (shape, _) in COLUMNS.items():
            setattr(self, name, nn.Parameter(torch.randn(shape, generator=g)))

    def forward(self, grads):
        return sum((p * grads[n]).sum() for n, p in self.named_parameters())


def gradients(seed):
    g = torch.Generator().manual_seed(seed + 1)
    return [{n: torch.randn(shape, generator=g) for n, (shape, _) in COLUMNS.items()}
            for _ in range(STEPS)]


def reference(seed, adjust_lr="original"):
    model = Columns(seed)
    ref = ReferenceMuon({n: p.detach().double().clone() for n, p in model.named_parameters()},
                        COLUMNS, splits={n: s for n, (_, s) in COLUMNS.items()},
                        split_dims={n: 1 for n in COLUMNS}, adjust_lr=adjust_lr, **HYPER)
    for g in gradients(seed):
        ref.step(g)
    return ref.p


def train(seed, shard=None, group_split=True, adjust_lr="original"):
    """Muon with column splits (by group, or by the plan's policy) after STEPS
    steps: the full parameters and Muon's matrices."""
    model = Columns(seed)
    if shard == "rfsdp":
        rfsdp.fully_shard(model, policy=rfsdp.policy.muon(
            split={n: s for n, (_, s) in COLUMNS.items()}, split_dim=1))
    elif shard == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        fully_shard(model, mesh=init_device_mesh("cpu", (torch.distributed.get_world_size(),)))
    named = dict(model.named_parameters())
    groups = [dict(params=[named[n]], split_sizes=s if group_split else None,
                   split_dim=1 if group_split else 0) for n, (_, s) in COLUMNS.items()]
    opt = rfsdp.optim.Muon(groups, adjust_lr=adjust_lr, **HYPER)
    for g in gradients(seed):
        opt.zero_grad()
        model(g).backward()
        opt.step()
    full = {n: t.detach().clone() for n, t in _full(model).items()}
    return full, opt._impl.matrices()


def _full(model):
    if any(rfsdp.shard_info(p) is not None for p in model.parameters()):
        return rfsdp.full_parameters(model)
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p)
            for n, p in model.named_parameters()}


@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_column_blocks_equal_the_float64_reference_on_one_device(adjust_lr):
    want = reference(0, adjust_lr)
    got, mats = train(0, adjust_lr=adjust_lr)
    for n in COLUMNS:
        torch.testing.assert_close(got[n].double(), want[n], rtol=0, atol=2e-5, msg=n)
    assert {tuple(m["col_blocks"]) for m in mats} == {tuple(s) for _, s in COLUMNS.values()}


def test_column_blocks_differ_from_whole_matrices_and_from_row_blocks():
    """(The comparisons above can fail: the split changes the result.)"""
    want = reference(0)
    whole, _ = train(0, group_split=False)
    assert max((want[n] - whole[n].double()).abs().max().item() for n in COLUMNS) > 1e-2


def _ranks(rank, world, seed, shard, group_split):
    full, mats = train(seed, shard=shard, group_split=group_split)
    return full, [(m["rows"], m["cols"], m["root"]) for m in mats]


@pytest.mark.parametrize("shard,group_split", [("rfsdp", False), ("rfsdp", True),
                                               ("fsdp2", True)])
def test_column_blocks_on_two_ranks_equal_one_device(shard, group_split):
    """rfsdp's plan (the policy's split_dim=1 keeps each split matrix whole: Muon
    takes the blocks from the plan) or the group's split; FSDP2's chunk rows cut
    the matrices, which go to their root whole."""
    one, _ = train(1)
    results = run_ranks(_ranks, 2, 1, shard, group_split, timeout=300)
    for full, _ in results:
        for n in COLUMNS:
            torch.testing.assert_close(full[n], one[n], rtol=0, atol=1e-6, msg=n)


def test_a_column_split_that_does_not_fit_names_the_parameter_and_the_dim():
    w = nn.Parameter(torch.randn(12, 20))
    with pytest.raises(ValueError, match=r"'w'.*sum to 12 columns, its matrix has 20"):
        rfsdp.optim.Muon([dict(params=[("w", w)], split_sizes=[6, 6], split_dim=1)])
    with pytest.raises(ValueError, match="split_dim must be 0"):
        rfsdp.optim.Muon([dict(params=[w], split_sizes=[10, 10], split_dim=2)])
    with pytest.raises(ValueError, match="split_dim must be 0"):
        rfsdp.policy.muon(split={"w": [10, 10]}, split_dim=2)


def _gpt2(seed):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def _gpt2_heads(model):
    """Every c_attn.weight's heads as column blocks: [head_dim] * 3 * n_heads."""
    cfg = model.config
    hd = cfg.n_embd // cfg.n_head
    return {n: [hd] * (3 * cfg.n_head) for n, _ in model.named_parameters()
            if n.endswith("attn.c_attn.weight")}


def _gpt2_train(rank, world, seed, shard):
    """GPT-2 (transformers' Conv1D fused QKV) with Muon per head: the policy keyed
    by the model's names, fully_shard bottom-up (rank 0's data on every rank)."""
    model = _gpt2(seed)
    heads = _gpt2_heads(model)
    if shard:
        pol = rfsdp.policy.muon(split=heads, split_dim=1)
        for block in model.transformer.h:
            rfsdp.fully_shard(block, policy=pol)
        rfsdp.fully_shard(model, policy=pol)
        groups = [dict(params=[p for p in model.parameters() if p.dim() >= 2]),
                  dict(params=[p for p in model.parameters() if p.dim() < 2], use_muon=False)]
    else:
        named = dict(model.named_parameters())
        groups = [dict(params=[named[n] for n in heads], split_sizes=next(iter(heads.values())),
                       split_dim=1),
                  dict(params=[p for n, p in named.items() if p.dim() >= 2 and n not in heads]),
                  dict(params=[p for p in named.values() if p.dim() < 2], use_muon=False)]
    opt = rfsdp.optim.Muon(groups, lr=0.02, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 12), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    col = sorted({tuple(m["col_blocks"]) for m in opt._impl.matrices() if m["col_blocks"]})
    full = rfsdp.full_parameters(model) if shard else \
        {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, full, col


def test_gpt2_conv1d_fused_qkv_per_head_on_two_ranks_equals_one_process():
    losses, want, col = _gpt2_train(0, 1, 3, False)
    assert col == [tuple(next(iter(_gpt2_heads(_gpt2(3)).values())))]
    for got_losses, full, got_col in run_ranks(_gpt2_train, 2, 3, True, timeout=300):
        assert got_col == col  # the plan carried the column split to Muon
        torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(losses), rtol=0,
                                   atol=1e-5)
        for n in want:
            got, ref = full[n], want[n]
            if n.endswith("c_attn.bias"):
                # The key bias: softmax does not see it, so its gradient is rounding
                # noise whose sign follows the sums' order, and Adam (lr 3e-4) moves it
                # by up to lr a step on that noise: held to 2 lr a step apart.
                d = ref.numel() // 3
                torch.testing.assert_close(got[d:2 * d], ref[d:2 * d], rtol=0, atol=2 * 3e-4 * 3)
                got, ref = torch.cat([got[:d], got[2 * d:]]), torch.cat([ref[:d], ref[2 * d:]])
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5, msg=n)
