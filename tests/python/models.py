"""The models and data the Python tests share (one definition each): a small
residual MLP (an embedding, blocks of Linear + LayerNorm, a head), its batches,
and its unsharded training with torch.optim.AdamW (the reference); the same shape
with a 3-D expert stack in each block (the Muon tests'); a tiny byte language
model (rfsdp.compare's "callable" configs)."""
import math
import os

import torch
from torch import nn

STEPS = 6
CLIP = 0.5  # small enough to clip most steps


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return x + torch.relu(self.fc(self.norm(x)))


class Net(nn.Module):
    def __init__(self, d=24, depth=3, out=5):
        super().__init__()
        self.embed = nn.Linear(7, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, out)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def data(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(STEPS, 16, 7, generator=g), torch.randn(STEPS, 16, 5, generator=g)


def reference(seed):
    """Net trained unsharded by torch.optim.AdamW, gradients clipped at CLIP: (each
    step's loss, the parameters)."""
    from slice_training import train_reference
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    losses = train_reference(model, opt, *data(seed), before_step=lambda: torch.nn.utils.
                             clip_grad_norm_(model.parameters(), CLIP))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def optimizer(name, params, **kw):
    """rfsdp.optim's optimizer `name` over params (a model's parameters, in order),
    with settings that exercise it within a few steps: Muon on the matrices (AdamW
    for the rest), Shampoo preconditioning from step 2, SOAP refreshing every 2."""
    import rfsdp
    params = list(params)
    if name == "AdamW":
        return rfsdp.optim.AdamW(params, lr=1e-2, weight_decay=0.05, **kw)
    if name == "AdamW8bit":
        return rfsdp.optim.AdamW8bit(params, lr=1e-2, weight_decay=0.05, min_8bit_size=64, **kw)
    if name == "Muon":
        return rfsdp.optim.Muon([dict(params=[p for p in params if p.dim() >= 2]),
                                 dict(params=[p for p in params if p.dim() < 2], use_muon=False)],
                                lr=0.02, weight_decay=0.01, **kw)
    if name == "Shampoo":
        return rfsdp.optim.Shampoo(params, lr=1e-2, precondition_frequency=2,
                                   start_preconditioning_step=2, **kw)
    if name == "SOAP":
        return rfsdp.optim.SOAP(params, lr=3e-3, precondition_frequency=2, **kw)
    raise ValueError(name)


OPTIMIZERS = ("AdamW", "AdamW8bit", "Muon", "Shampoo", "SOAP")


def fsdp2(model, world):
    """Net sharded by torch's fully_shard over a 1-D CPU mesh of `world` ranks, block
    by block, then the rest; returns (model, mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, mesh


def full_params(model):
    """Every parameter whole, by name (collective where sharded): rfsdp.fully_shard's
    gathered rows, an FSDP2 DTensor's full_tensor(), or a copy of the tensor."""
    import rfsdp
    if any(rfsdp.shard_info(p) is not None for p in model.parameters()):
        return rfsdp.full_parameters(model)
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


# ---- blocks with a 3-D expert stack: what Muon takes, several matrices a parameter ----------

EXPERT_STEPS = 8
EXPERT_BATCH = 12


class Experts(nn.Module):
    def __init__(self, d, e=3):
        super().__init__()
        self.w = nn.Parameter(torch.randn(e, d, d) / math.sqrt(d))

    def forward(self, x):
        return sum(x @ self.w[i] for i in range(self.w.shape[0])) / self.w.shape[0]


class ExpertBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.experts = Experts(d)

    def forward(self, x):
        return x + self.experts(torch.tanh(self.fc(self.norm(x))))


class ExpertNet(nn.Module):
    """An embedding, blocks of LayerNorm, Linear and an [E, H, I] expert stack, a head."""

    def __init__(self, d=12, depth=2):
        super().__init__()
        self.embed = nn.Linear(7, d)
        self.blocks = nn.ModuleList(ExpertBlock(d) for _ in range(depth))
        self.head = nn.Linear(d, 5)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def is_expert_muon(name, p):
    """ExpertNet's parameters that Muon takes: the blocks' matrices and expert stacks."""
    return name.startswith("blocks.") and p.dim() >= 2


def expert_data(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(EXPERT_STEPS, EXPERT_BATCH, 7, generator=g),
            torch.randn(EXPERT_STEPS, EXPERT_BATCH, 5, generator=g))


# ---- a tiny byte language model, for rfsdp.compare's "callable" configs --------------------

class TinyLM(nn.Module):
    """Embedding, one hidden layer, head: tokens [B, T] -> logits [B, T, 256]."""

    def __init__(self, ctx, width=16):
        super().__init__()
        self.tok = nn.Embedding(256, width)
        self.fc = nn.Linear(width, 2 * width)
        self.mix = nn.Linear(2 * width, width)
        self.head = nn.Linear(width, 256, bias=False)

    def forward(self, idx):
        return self.head(self.mix(torch.nn.functional.gelu(self.fc(self.tok(idx)))))


def crash_once_lm(ctx, width=16, marker=None):
    """TinyLM, but the first build under seed 1 kills rank 1 (a hard crash: the
    worker process dies); the marker file remembers it happened."""
    if (torch.initial_seed() == 1 and os.environ.get("RANK") == "1" and marker
            and not os.path.exists(marker)):
        open(marker, "w").close()
        os._exit(3)
    return TinyLM(ctx, width)
