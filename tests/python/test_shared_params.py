"""Parameters used in more than one place. A GPT-style model whose head is tied
to its embedding (head.weight = emb.weight), fully sharded on 2 ranks
(processes, Gloo), trains like the unsharded model with the same optimizer on the
whole batch (AdamW, AdamW8bit, Muon with the embedding/head in its AdamW group).
Sharing that a shard cannot keep (a parameter across two units; two parameters
over one memory) is refused with an error naming both."""
import os
import sys

import pytest
import torch
from torch import nn

import rfsdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from slice_training import train_on_slices, train_reference  # noqa: E402
from models import Block  # noqa: E402
from ranks import run_ranks  # noqa: E402

VOCAB, DIM, CTX, BATCH, STEPS, WORLD, LR = 40, 16, 6, 8, 5, 2, 1e-2


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied, as GPT-2

    def forward(self, idx):
        h = self.emb(idx)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def make_optimizer(name, model):
    if name == "adamw":
        return rfsdp.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    if name == "adamw8bit":
        return rfsdp.optim.AdamW8bit(model.parameters(), lr=LR, weight_decay=0.05, block=256,
                                     min_8bit_size=256)
    matrices = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
    ids = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return rfsdp.optim.Muon([dict(params=matrices), dict(params=rest, use_muon=False, lr=1e-2)],
                            lr=0.02, weight_decay=0.01)


def policy(name):
    return {"adamw": None, "adamw8bit": rfsdp.policy.blockwise_8bit(256),
            "muon": rfsdp.policy.muon()}[name]


def data(seed):
    g = torch.Generator().manual_seed(seed + 7)
    return torch.randint(0, VOCAB, (STEPS, BATCH, CTX + 1), generator=g)


def loss_of(model, tokens):
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def reference(name, seed):
    torch.manual_seed(seed)
    model = TiedLM()
    tokens = data(seed)
    losses = train_reference(model, make_optimizer(name, model), tokens, tokens,
                             loss_of=lambda m, t, _: loss_of(m, t))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def worker(rank, world, name, seed):
    torch.manual_seed(seed)
    model = TiedLM()
    for b in model.blocks:
        rfsdp.fully_shard(b, policy=policy(name))
    rfsdp.fully_shard(model, policy=policy(name))
    assert model.head.weight is model.emb.weight  # still one parameter, one shard
    opt = make_optimizer(name, model)
    tokens = data(seed)
    losses = train_on_slices(model, opt, tokens, tokens, rank, WORLD,
                             loss_of=lambda m, t, _: loss_of(m, t))
    return {"losses": losses, "params": rfsdp.full_parameters(model)}


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "muon"])
def test_tied_embedding_and_head_train_like_unsharded(name):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    ref_losses, ref_params = reference(name, seed)
    got = run_ranks(worker, WORLD, name, seed)[0]
    loss_rel = 1e-4 if name == "adamw8bit" else 1e-5  # a code flip (below) moves the loss a little
    assert got["losses"] == pytest.approx(ref_losses, rel=loss_rel, abs=1e-6), "seed %d" % seed
    assert set(got["params"]) == set(ref_params)  # the tie is one parameter on both sides
    for n, want in ref_params.items():
        have = got["params"][n]
        if name == "adamw8bit":
            # The sharded gradient is summed in another order than the whole batch's, so a
            # state value on a code boundary may round to the neighbouring 8-bit code: that
            # element then moves by up to a step's update (lr) per remaining step. Allow it
            # for a few elements; everything else must agree to fp32.
            off = (have - want).abs() > 1e-5 + 1e-5 * want.abs()
            assert off.float().mean() <= 0.01, "%s (seed %d): %d elements off" % (n, seed, off.sum())
            assert ((have - want).abs()[off] <= 2 * LR * STEPS).all(), "%s (seed %d)" % (n, seed)
            have = torch.where(off, want, have)
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: "%s (seed %d): %s" % (n, seed, m))


def test_parameter_shared_by_two_units_is_refused(one_rank):
    model = TiedLM()
    rfsdp.fully_shard(model.emb)  # claims the tied weight; the head stays in the root's call
    with pytest.raises(ValueError, match="'head.weight' is the parameter 'weight'.*two units"):
        rfsdp.fully_shard(model)


def test_two_parameters_over_one_memory_are_refused(one_rank):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = nn.Parameter(model[0].weight.data)  # a second Parameter, same storage
    with pytest.raises(ValueError, match="'0.weight' and '1.weight' are different tensors over "
                                         "the same memory"):
        rfsdp.fully_shard(model)


def test_module_used_twice_and_two_forwards_before_backward(one_rank):
    """One unit called twice in a forward, and two forwards before one backward:
    gradients equal the unsharded model's."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
    model.load_state_dict(ref.state_dict())
    rfsdp.fully_shard(model[0])
    rfsdp.fully_shard(model)
    x1, x2 = torch.randn(3, 6), torch.randn(5, 6)
    for m in (ref, model):
        (m(m(x1)).sum() + m(x2).pow(2).sum()).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for n, p in ref.named_parameters():
        info = rfsdp.shard_info(dict(model.named_parameters())[n])
        want = p.grad.reshape(info.full_rows, -1)[info.row_begin:info.row_end]
        torch.testing.assert_close(grads[n].reshape(want.shape), want, rtol=1e-6, atol=1e-6)
