"""rfsdp.fully_shard against the real anchor, torch's FSDP2: the same model,
seed and data on 2 ranks (processes, Gloo), 10 steps of torch.optim.AdamW over
(a) rfsdp's ragged shards and (b) FSDP2's DTensor shards. Losses and the full
parameters at the end must agree."""
import os
import sys

import pytest
import torch

import rfsdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from slice_training import assert_trains_like, train_on_slices  # noqa: E402
from models import Net  # noqa: E402  (embedding, 3 residual blocks, head)
from ranks import run_ranks  # noqa: E402

STEPS = 10
WORLD = 2


def train(model, rank, seed):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    g = torch.Generator().manual_seed(seed + 1)
    xs, ys = torch.randn(STEPS, 16, 7, generator=g), torch.randn(STEPS, 16, 5, generator=g)
    return train_on_slices(model, opt, xs, ys, rank, WORLD)


def worker(rank, world, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    torch.manual_seed(seed)
    ours = Net()
    for b in ours.blocks:
        rfsdp.fully_shard(b)
    rfsdp.fully_shard(ours)
    ours_losses = train(ours, rank, seed)
    ours_params = rfsdp.full_parameters(ours)

    torch.manual_seed(seed)
    theirs = Net()
    mesh = init_device_mesh("cpu", (WORLD,))
    for b in theirs.blocks:
        fsdp2_fully_shard(b, mesh=mesh)
    fsdp2_fully_shard(theirs, mesh=mesh)
    theirs_losses = train(theirs, rank, seed)
    theirs_params = {n: p.full_tensor().detach() for n, p in theirs.named_parameters()}
    return {"ours": (ours_losses, ours_params), "fsdp2": (theirs_losses, theirs_params)}


def test_rfsdp_shards_train_like_fsdp2():
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    got = run_ranks(worker, WORLD, seed)[0]
    ours_losses, ours_params = got["ours"]
    fsdp2_losses, fsdp2_params = got["fsdp2"]
    assert ours_losses == pytest.approx(fsdp2_losses, rel=1e-5, abs=0), "seed %d" % seed
    assert_trains_like(fsdp2_params, ours_params, 1e-5, 1e-6, "seed %d" % seed)
