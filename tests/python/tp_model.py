"""A transformer block parallelised as torchtitan does (torch's parallelize_module
with ColwiseParallel / RowwiseParallel over mesh["tp"], then torch FSDP2's
fully_shard over mesh["dp"]), its data, and the one-process reference loop: what
the tensor-parallel tests share.

The fused QKV is stored head-major ([head][q, k, v][head_dim] rows), so
ColwiseParallel's row chunks give each tp rank whole heads (HEADS divides by tp)
and the same forward runs on one process and on a tp rank's heads."""
import torch
import torch.distributed as dist
from torch import nn

DIM, HEADS, FFN = 8, 2, 16
BATCH, SEQ = 4, 3


class Block(nn.Module):
    def __init__(self, dim=DIM, heads=HEADS, ffn=FFN):
        super().__init__()
        self.head_dim = dim // heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)  # (a k bias has no gradient but rounding: Adam would amplify it)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, ffn)
        self.fc2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, -1, 3, self.head_dim)  # (local heads under tp)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


MATRICES = ("qkv.weight", "proj.weight", "fc1.weight", "fc2.weight")


def data(seed, steps):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(steps, BATCH, SEQ, DIM, generator=g),
            torch.randn(steps, BATCH, SEQ, DIM, generator=g))


def mesh_2d(dp=2, tp=2):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def tensor_parallel(model, mesh):
    """model with torch's tensor parallelism over mesh["tp"] (the block's columns
    and rows as torchtitan splits a layer's), then torch FSDP2 over mesh["dp"]."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    parallelize_module(model, mesh["tp"], {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                                           "fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model


def train(model, opt, xs, ys, dp_rank=0, dp=1, before_step=None):
    """Each step: this dp rank's slice of the batch (tp ranks share it), mse_loss,
    backward, before_step(), opt.step(). Returns each step's loss of the whole batch."""
    per = xs.shape[1] // dp
    losses = []
    for x, y in zip(xs, ys):
        sl = slice(dp_rank * per, (dp_rank + 1) * per)
        loss = nn.functional.mse_loss(model(x[sl]), y[sl])
        opt.zero_grad()
        loss.backward()
        if before_step:
            before_step()
        opt.step()
        t = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(t)
            t /= dist.get_world_size()
        losses.append(t.item())
    return losses


def full_of(model):
    """{name: the whole tensor} of every parameter (DTensors gathered: collective)."""
    from torch.distributed.tensor import DTensor
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}
