"""Flows users bring that held when tried (issue 51's first round), kept from
regressing: PyTorch Lightning's Trainer with DDP on 2 CPU processes and an rfsdp
optimizer equals one process; torch.compile of rfsdp.fully_shard blocks (each
block compiled, or the whole model) equals eager; a multi-node launch (two
torchrun nodes, c10d rendezvous) under HSDP equals one process."""
import os
import sys

import pytest
import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import habits_worker  # noqa: E402
from models import Net, data, optimizer  # noqa: E402
from ranks import torchrun  # noqa: E402
from slice_training import assert_trains_like  # noqa: E402

WORKER = os.path.join(HERE, "habits_worker.py")


@pytest.mark.parametrize("name", ["Muon", "AdamW8bit"])
def test_lightning_ddp_with_an_rfsdp_optimizer_equals_one_process(name, tmp_path):
    pytest.importorskip("pytorch_lightning")
    habits_worker.plain(name, tmp_path / "one.pt")
    torchrun(WORKER, ["lightning", name, tmp_path / "two.pt"], nproc=2,
             env=dict(PL_DISABLE_FORK="1"), timeout=300)
    want, got = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    start = (torch.manual_seed(habits_worker.SEED), Net())[1].state_dict()
    assert all(not torch.equal(want[n], start[n]) for n in want), "the run moves every parameter"
    # two ranks average their halves' gradients: rounding apart from one process
    assert_trains_like(want, got, 0, 2e-6, "Lightning DDP %s" % name)


def test_a_multi_node_launch_under_hsdp_equals_one_process(tmp_path):
    habits_worker.plain("AdamW", tmp_path / "one.pt")
    torchrun(WORKER, ["hsdp", tmp_path / "two.pt"], nproc=1, nnodes=2, timeout=300)
    assert_trains_like(torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt"), 0, 1e-6,
                       "2 nodes, HSDP")


def _compiled_run(where):
    import rfsdp
    torch.manual_seed(3)
    model = Net()
    for b in model.blocks:
        rfsdp.fully_shard(b)
    rfsdp.fully_shard(model)
    run = model
    if where == "blocks":
        for b in model.blocks:
            b.compile(backend="aot_eager")
    elif where == "model":
        run = torch.compile(model, backend="aot_eager")
    opt = optimizer("AdamW", model.parameters())
    xs, ys = data(3)
    losses = []
    for x, y in zip(xs, ys):
        loss = nn.functional.mse_loss(run(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: t.clone() for n, t in rfsdp.full_parameters(model).items()}


@pytest.mark.parametrize("where", ["blocks", "model"])
def test_torch_compile_of_sharded_blocks_equals_eager(one_rank, where):
    """(aot_eager: torch.compile's tracing and autograd around rfsdp's hooks, as
    inductor sees them, without its C++ compile time in the suite.)"""
    torch._dynamo.reset()
    eager = _compiled_run(None)
    got = _compiled_run(where)
    assert got[0] == pytest.approx(eager[0], rel=1e-6, abs=1e-7)
    assert_trains_like(eager[1], got[1], 0, 1e-6, "compiled %s" % where)
