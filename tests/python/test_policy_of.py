"""rfsdp.policy.of(opt): the plan's policy from the optimizer's own settings (a
block, a tile, a split stated once). Its granules and blocks equal the policies
written by hand with the same numbers; on 2 ranks an AdamW8bit planned with it
shares no block and trains bit for bit as with the hand-written policy, where a
hand-written policy with another block makes shared blocks."""
import os
import sys

import pytest
import torch
from torch import nn

import rfsdp
from rfsdp import policy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import Net, data  # noqa: E402
from ranks import run_ranks  # noqa: E402


def plans(pol, model):
    return {n: (pol.granule(n, p), pol.row_dims(n, p), pol.blocks(n, p))
            for n, p in model.named_parameters()}


def test_policy_of_equals_the_hand_written_policy():
    torch.manual_seed(0)
    model = Net()
    named = dict(model.named_parameters())
    big = [n for n, p in named.items() if p.numel() >= 64]
    opt = rfsdp.optim.AdamW8bit(model.parameters(), block=(4, 8), min_8bit_size=64)
    want = {n: (policy.blockwise_8bit((4, 8)).granule(n, p) if n in big else 1, 1, None)
            for n, p in named.items()}
    assert plans(policy.of(opt), model) == want
    assert any(g != 1 for g, _, _ in want.values())

    opt = rfsdp.optim.Shampoo(model.parameters(), max_preconditioner_dim=8)
    assert plans(policy.of(opt), model) == plans(policy.shampoo(8), model)
    assert plans(policy.of(rfsdp.optim.AdamW(model.parameters())), model) == \
        plans(policy.adamw(), model)

    qkv = "blocks.0.fc.weight"
    mats = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    split = [dict(params=[named[qkv]], split_sizes=[named[qkv].shape[0] // 4] * 4),
             dict(params=[p for p in mats if p is not named[qkv]]),
             dict(params=rest, use_muon=False)]
    opt = rfsdp.optim.Muon(split, momentum_dtype="int8", momentum_block=32)
    hand = policy.combine(policy.muon(split={qkv: [named[qkv].shape[0] // 4] * 4}),
                          policy.Policy(lambda n, p, rd: policy.blockwise_8bit(32).granule(n, p, rd)
                                        if p.dim() == 2 else 1))
    got = plans(policy.of(opt), model)
    assert got == plans(hand, model)
    assert got[qkv][2] == [named[qkv].shape[0] // 4] * 4


def test_policy_of_refuses_what_it_cannot_read():
    model = Net()
    with pytest.raises(ValueError, match="not an rfsdp optimizer"):
        policy.of(torch.optim.AdamW(model.parameters()))


def _train(rank, world, how):
    torch.manual_seed(0)
    model = Net()
    opt = rfsdp.optim.AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=64)
    pol = {"of": policy.of(opt), "hand": policy.blockwise_8bit(256),
           "other": policy.blockwise_8bit(32)}[how]
    for b in model.blocks:
        rfsdp.fully_shard(b, policy=pol)
    rfsdp.fully_shard(model, policy=pol)
    losses = []
    for x, y in zip(*data(1)):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    late = None
    if how == "of":  # built after sharding: policy.of cannot plan any more
        try:
            policy.of(rfsdp.optim.AdamW8bit(model.parameters()))
        except ValueError as e:
            late = str(e)
    return losses, rfsdp.full_parameters(model), opt.shared_blocks(), late


def _all(rank, world):
    return {how: _train(rank, world, how) for how in ("of", "hand", "other")}


def test_policy_of_plans_whole_blocks_on_two_ranks():
    for r in run_ranks(_all, 2, timeout=300):
        of, hand, other = r["of"], r["hand"], r["other"]
        assert of[2] == 0 and hand[2] == 0 and other[2] > 0
        assert of[0] == hand[0]
        for n in of[1]:
            assert torch.equal(of[1][n], hand[1][n]), n
        assert "before rfsdp.fully_shard" in of[3]
