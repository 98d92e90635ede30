"""Run by test_muon_py.py under torchrun: a small model with 2-D weights and a
3-D expert stack, fully sharded, trained with rfsdp.optim.Muon (+ AdamW for the
rest); rank 0 saves the per-step losses and the full parameters."""
import argparse
import math

import os

import torch
import torch.distributed as dist
from torch import nn

import rfsdp
from slice_training import train_on_slices  # (this script's folder is on sys.path)

STEPS = 8
BATCH = 12


class Experts(nn.Module):
    def __init__(self, d, e=3):
        super().__init__()
        self.w = nn.Parameter(torch.randn(e, d, d) / math.sqrt(d))

    def forward(self, x):
        return sum(x @ self.w[i] for i in range(self.w.shape[0])) / self.w.shape[0]


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.experts = Experts(d)

    def forward(self, x):
        return x + self.experts(torch.tanh(self.fc(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d=12, depth=2):
        super().__init__()
        self.embed = nn.Linear(7, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, 5)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def is_muon(name, p):
    return name.startswith("blocks.") and p.dim() >= 2


def data(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(STEPS, BATCH, 7, generator=g), torch.randn(STEPS, BATCH, 5, generator=g)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--whole", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = Net()
    muon_names = {n for n, p in model.named_parameters() if is_muon(n, p)}
    for b in model.blocks:
        rfsdp.fully_shard(b, policy=rfsdp.policy.muon(whole=args.whole))
    rfsdp.fully_shard(model)
    muon_p = [p for n, p in model.named_parameters() if n in muon_names]
    aux_p = [p for n, p in model.named_parameters() if n not in muon_names]
    opt = rfsdp.optim.Muon([dict(params=muon_p, use_muon=True),
                            dict(params=aux_p, use_muon=False, lr=3e-3)],
                           lr=0.02, weight_decay=0.01)
    xs, ys = data(args.seed)
    losses = train_on_slices(model, opt, xs, ys, rank, world)
    params = rfsdp.full_parameters(model)
    moved = torch.tensor([float(opt._impl.gather_send_elems())])
    dist.all_reduce(moved)
    if rank == 0:
        torch.save({"losses": losses, "params": params, "moved": moved.item(),
                    "imbalance": opt._impl.flop_imbalance()}, args.out)
    dist.barrier()
    os._exit(0)  # (torch's Gloo threads may abort a normal exit: see rfsdp._comm)


if __name__ == "__main__":
    main()
