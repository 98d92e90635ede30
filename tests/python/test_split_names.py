"""Names as users write them: rfsdp.policy.muon(split={name: sizes}) keyed by the
names model.named_parameters() gives works under the README's bottom-up pattern
(fully_shard per block, then the model: the blocks are planned again at the
model's call), as keyed by the names relative to each block; a name that matches
no parameter is an error naming it and the nearest names; and errors about a
parameter name it as named_parameters() does."""
import os
import sys

import pytest
import torch
from torch import nn

import rfsdp

sys.path.insert(0, os.path.dirname(__file__))
from ranks import run_ranks  # noqa: E402

HEADS = 4  # per-head blocks of 4 rows of each 16 x 16 projection


class Attn(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return x + self.proj(torch.tanh(q) * torch.sigmoid(k) + v)


class Model(nn.Module):
    def __init__(self, depth=3, d=16):
        super().__init__()
        self.embed = nn.Linear(5, d)
        self.layers = nn.ModuleList(Attn(d) for _ in range(depth))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _split(model, relative):
    """Per-head blocks of every qkv (q, k, v: 4 heads of 4 rows each)."""
    names = [n for n, _ in model.named_parameters() if n.endswith("qkv.weight")]
    if relative:
        return {"qkv.weight": [4] * 12}
    return {n: [4] * 12 for n in names}


def _train(rank, world, seed, keys, steps=3):
    torch.manual_seed(seed)
    model = Model()
    if keys == "none":
        split = None
    else:
        split = _split(model, keys == "relative")
    pol = rfsdp.policy.muon(split=split)
    for layer in model.layers:
        rfsdp.fully_shard(layer, policy=pol)
    rfsdp.fully_shard(model, policy=pol)
    planned = {n: list(rfsdp.shard_info(p).shard.blocks) for n, p in model.named_parameters()
               if rfsdp.shard_info(p).shard.blocks}
    names = {n: rfsdp.shard_info(p).name for n, p in model.named_parameters()}
    opt = rfsdp.optim.Muon([dict(params=[p for p in model.parameters() if p.dim() >= 2]),
                            dict(params=[p for p in model.parameters() if p.dim() < 2],
                                 use_muon=False)], lr=0.02)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return (planned, len(opt._impl.matrices()), names,
            {n: t.clone() for n, t in rfsdp.full_parameters(model).items()})


@pytest.fixture(scope="module")
def runs():
    return {keys: run_ranks(_train, 2, 0, keys, timeout=300)
            for keys in ("model", "relative", "none")}


def test_names_from_named_parameters_split_under_the_bottom_up_pattern(runs):
    for planned, n_matrices, _, _ in runs["model"]:
        assert planned == {"layers.%d.qkv.weight" % i: [4] * 12 for i in range(3)}
        # qkv: 12 blocks each, proj, embed and head whole: 3 * 12 + 3 + 2
        assert n_matrices == 3 * 12 + 3 + 2


def test_names_from_the_model_equal_names_relative_to_the_block(runs):
    for (pa, na, _, fa), (pb, nb, _, fb) in zip(runs["model"], runs["relative"]):
        assert pa == pb and na == nb
        for n in fa:
            assert torch.equal(fa[n], fb[n]), n


def test_the_split_changes_the_result(runs):
    """(So the comparisons above can fail.)"""
    split, whole = runs["model"][0][3], runs["none"][0][3]
    assert runs["none"][0][1] == 3 + 3 + 2
    assert max((split[n] - whole[n]).abs().max().item() for n in split) > 1e-3


def test_shards_are_named_as_the_model_names_them(runs):
    for _, _, names, _ in runs["model"]:
        assert names == {n: n for n in names}


def test_a_name_that_matches_nothing_is_an_error_naming_it_and_the_nearest(one_rank):
    model = Model()
    pol = rfsdp.policy.muon(split={"layers.0.qkv.weight": [4] * 12,
                                   "layers.1.qvk.weight": [4] * 12})
    for layer in model.layers:
        rfsdp.fully_shard(layer, policy=pol)
    rfsdp.fully_shard(model, policy=pol)
    with pytest.raises(ValueError, match=r"'layers.1.qvk.weight' \(nearest: 'layers.1.qkv.weight'"):
        rfsdp.optim.Muon(model.parameters())


def test_a_name_of_a_vector_is_an_error(one_rank):
    model = Model()
    with pytest.raises(ValueError, match="'head.bias' of shape \\(3,\\), which is not a Muon matrix"):
        rfsdp.fully_shard(model, policy=rfsdp.policy.muon(split={"head.bias": [1, 2]}))


def test_two_names_of_one_parameter_with_other_blocks_are_an_error(one_rank):
    model = Model()
    pol = rfsdp.policy.muon(split={"qkv.weight": [4] * 12, "layers.0.qkv.weight": [16] * 3})
    for layer in model.layers:
        rfsdp.fully_shard(layer, policy=pol)
    with pytest.raises(ValueError, match="'layers.0.qkv.weight'.*give one of them"):
        rfsdp.fully_shard(model, policy=pol)


def test_a_split_that_does_not_fit_names_the_parameter_as_named_parameters_does(one_rank):
    model = Model()
    with pytest.raises(ValueError, match="'layers.2.proj.weight'.*sum to 10 rows"):
        rfsdp.optim.Muon([dict(params=list(model.named_parameters())[-4:-2], split_sizes=[4, 6])])
    for layer in model.layers:
        rfsdp.fully_shard(layer)
    rfsdp.fully_shard(model)
    # (rfsdp's shards carry the model's names without named_parameters)
    with pytest.raises(ValueError, match="'layers.1.proj.weight'.*sum to 10 rows"):
        rfsdp.optim.Muon([dict(params=[model.layers[1].proj.weight], split_sizes=[4, 6])])
