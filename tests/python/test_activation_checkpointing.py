"""Activation checkpointing of fully sharded blocks on 2 ranks (processes, Gloo):
the recomputation in backward gathers the unit again, and training equals the
unsharded model without checkpointing (torch.optim.AdamW, clipped). Reentrant
and non-reentrant checkpoints, with and without reshard after forward; prefetch
is on from the second step. Also: eval under no_grad, frozen parameters,
torch.compile of a sharded block."""
import os
import sys

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import rfsdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from slice_training import assert_trains_like, train_on_slices  # noqa: E402
from models import CLIP, Net, data, reference  # noqa: E402
from ranks import run_ranks  # noqa: E402

WORLD = 2


class CheckpointedNet(Net):
    def __init__(self, use_reentrant):
        super().__init__()
        self.use_reentrant = use_reentrant

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = checkpoint(b, h, use_reentrant=self.use_reentrant)
        return self.head(h)


def worker(rank, world, seed, use_reentrant, reshard):
    torch.manual_seed(seed)
    model = CheckpointedNet(use_reentrant)
    for b in model.blocks:
        rfsdp.fully_shard(b, reshard_after_forward=reshard)
    rfsdp.fully_shard(model)
    opt = rfsdp.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    xs, ys = data(seed)
    losses = train_on_slices(model, opt, xs, ys, rank, WORLD,
                             before_step=lambda: rfsdp.clip_grad_norm_(model, CLIP))
    return {"losses": losses, "params": rfsdp.full_parameters(model)}


@pytest.mark.parametrize("use_reentrant,reshard", [(False, True), (False, False), (True, True),
                                                   (True, False)])
def test_checkpointed_blocks_train_like_unsharded(use_reentrant, reshard):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    ref_losses, ref_params = reference(seed)
    got = run_ranks(worker, WORLD, seed, use_reentrant, reshard)[0]
    assert got["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), "seed %d" % seed
    assert_trains_like(ref_params, got["params"], 1e-5, 1e-5, "seed %d" % seed)


def unsharded_and_sharded(prepare=None):
    """Two Nets with the same values (seed 0), prepare(net) applied to both; the
    second fully sharded (each block a unit, then the root)."""
    torch.manual_seed(0)
    ref, model = Net(), Net()
    model.load_state_dict(ref.state_dict())
    for m in (ref, model):
        if prepare:
            prepare(m)
    for b in model.blocks:
        rfsdp.fully_shard(b)
    rfsdp.fully_shard(model)
    return ref, model


def test_eval_under_no_grad_and_frozen_parameters(one_rank):
    ref, model = unsharded_and_sharded(lambda m: m.embed.weight.requires_grad_(False))  # frozen
    x = torch.randn(4, 7)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    model.train()
    model(x).sum().backward()
    ref(x).sum().backward()
    assert model.embed.weight.grad is None
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.requires_grad:
            torch.testing.assert_close(p.grad.reshape(q.shape), q.grad, rtol=1e-6, atol=1e-6)


def test_compiled_block_matches_eager(one_rank):
    """torch.compile of a sharded block (the unit's hooks run around the compiled
    forward): losses and gradients equal the unsharded eager model's, and the
    block's forward ran the compiled graph each step (a silent fall-back to eager
    would not count)."""
    from torch._inductor.compile_fx import compile_fx
    calls = dict(graphs=0, runs=0)

    def counting_inductor(gm, example_inputs):  # inductor, with its graphs' calls counted
        compiled = compile_fx(gm, example_inputs)
        calls["graphs"] += 1

        def run(*args):
            calls["runs"] += 1
            return compiled(*args)
        return run

    ref, model = unsharded_and_sharded()
    model.blocks[1] = torch.compile(model.blocks[1], backend=counting_inductor)
    xs, ys = data(0)
    for i in range(2):
        loss = nn.functional.mse_loss(model(xs[i]), ys[i])
        want = nn.functional.mse_loss(ref(xs[i]), ys[i])
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
        loss.backward()
        want.backward()
    assert calls["graphs"] >= 1 and calls["runs"] >= 2, calls
    grads = {n.replace("_orig_mod.", ""): p.grad for n, p in model.named_parameters()}
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n].reshape(p.shape), p.grad, rtol=1e-5, atol=1e-6)


def test_unit_without_gradient_in_a_step(one_rank):
    """A block the forward skips has no gradient that step: its unit reduces
    nothing, the optimizer skips its parameters (as torch's AdamW does), and
    training equals the unsharded model's."""
    ref, model = unsharded_and_sharded()
    opts = [torch.optim.AdamW(ref.parameters(), lr=1e-2), rfsdp.optim.AdamW(model.parameters(), lr=1e-2)]
    xs, ys = data(0)

    def forward(m, x, skip):
        h = m.embed(x)
        for i, b in enumerate(m.blocks):
            if i != skip:
                h = b(h)
        return m.head(h)

    for step in range(4):
        skip = 1 if step % 2 else None  # block 1 sits out odd steps
        for m, opt in zip((ref, model), opts):
            opt.zero_grad()
            nn.functional.mse_loss(forward(m, xs[step], skip), ys[step]).backward()
            opt.step()
        assert all(p.grad is None for p in model.blocks[1].parameters()) == (skip == 1)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.detach().reshape(q.shape), q.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: "%s: %s" % (n, m))
