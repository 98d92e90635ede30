"""rfsdp's optimizers on parameters sharded by torch's FSDP2 (DTensor Shard(0),
torch.chunk rows), 3 ranks (processes, Gloo), rows that 3 does not divide (the
last rank short; a 3-row matrix gives each rank one row): Muon against the
float64 single-device Muon (muon_reference.py) on the whole batch, AdamW
against torch's AdamW unsharded; AdamW8bit and Shampoo where the chunks hold
whole blocks and tiles against the same optimizer in one process (a cut tile is
refused); placements rfsdp does not take are refused
naming the parameter and the placement."""
import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import rfsdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import muon_reference  # noqa: E402
from slice_training import train_on_slices  # noqa: E402

WORLD = 3
STEPS = 5
HYPER = dict(lr=0.02, momentum=0.95, weight_decay=0.01)


class Odd(nn.Module):
    """Row counts 13, 5 and 3 (none divisible by 3), biases, a 3-D expert stack."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 13)
        self.b = nn.Linear(13, 5)
        self.c = nn.Linear(5, 3, bias=False)
        self.experts = nn.Parameter(torch.randn(4, 3, 3) * 0.3)

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        h = self.c(h)
        return torch.einsum("bi,eij->bj", h, self.experts)


def data(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(STEPS, 12, 7, generator=g), torch.randn(STEPS, 12, 3, generator=g)


def muon_names(model):
    return [n for n, p in model.named_parameters() if p.dim() >= 2]


def fsdp2(model, mesh):
    from torch.distributed.fsdp import fully_shard
    fully_shard(model.a, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_of(model):
    return {n: p.full_tensor().detach() for n, p in model.named_parameters()}


def aligned_optimizer(name, params):
    if name == "8bit":
        return rfsdp.optim.AdamW8bit(params, lr=1e-2, block=256)
    return rfsdp.optim.Shampoo(params, lr=1e-2, max_preconditioner_dim=32,
                               precondition_frequency=2, start_preconditioning_step=2)


def aligned_grads(seed):
    g = torch.Generator().manual_seed(seed + 11)
    return [(torch.randn(96, 64, generator=g), torch.randn(96, generator=g)) for _ in range(STEPS)]


def worker(rank, seed, init_file, out_file, mesh_shape=(WORLD,)):
    torch.set_num_threads(1)
    world = 1
    for n in mesh_shape:
        world *= n
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")[-len(mesh_shape):])
    xs, ys = data(seed)
    out = {}

    torch.manual_seed(seed)
    model = fsdp2(Odd(), mesh)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    names = muon_names(model)
    opt = rfsdp.optim.Muon([dict(params=[p for n, p in model.named_parameters() if n in names]),
                            dict(params=[p for n, p in model.named_parameters() if n not in names],
                                 use_muon=False, lr=3e-4)], **HYPER)
    out["muon_losses"] = train_on_slices(model, opt, xs, ys, rank, world)
    out["muon"] = full_of(model)
    if len(mesh_shape) == 2:  # HSDP: Muon only
        if rank == 0:
            torch.save(out, out_file)
        dist.barrier()
        dist.destroy_process_group()
        return

    torch.manual_seed(seed)
    model = fsdp2(Odd(), mesh)
    opt = rfsdp.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    out["adamw_losses"] = train_on_slices(model, opt, xs, ys, rank, WORLD)
    out["adamw"] = full_of(model)

    # AdamW8bit and Shampoo where FSDP2's chunks hold whole blocks / tiles (96 rows:
    # 32 a rank, 8-row blocks of 256, 32-row tiles), on given gradients: equal to one
    # process; a chunk that cuts a tile (13 rows: 5, 5, 3) is refused, saying so.
    for name in ("8bit", "shampoo"):
        w = nn.Parameter(distribute_tensor(torch.zeros(96, 64), mesh, [Shard(0)]))
        b = nn.Parameter(distribute_tensor(torch.zeros(96), mesh, [Shard(0)]))
        opt = aligned_optimizer(name, [w, b])
        for g_w, g_b in aligned_grads(seed):
            w.grad = distribute_tensor(g_w, mesh, [Shard(0)])
            b.grad = distribute_tensor(g_b, mesh, [Shard(0)])
            opt.step()
        out[name] = (w.full_tensor(), b.full_tensor())
    cut = nn.Parameter(distribute_tensor(torch.zeros(13, 64), mesh, [Shard(0)]))
    with pytest.raises(ValueError, match="FSDP2"):
        rfsdp.optim.Shampoo([cut], max_preconditioner_dim=32)

    # Placements rfsdp's optimizers do not take: refused, naming both.
    w = nn.Parameter(distribute_tensor(torch.randn(6, 6), mesh, [Shard(1)]))
    with pytest.raises(ValueError, match=r"param 0.*Shard\(dim=1\)"):
        rfsdp.optim.Muon([w])
    r = nn.Parameter(distribute_tensor(torch.randn(6, 6), mesh, [Replicate()]))
    with pytest.raises(ValueError, match="replicated"):
        rfsdp.optim.AdamW([r])
    if rank == 0:
        torch.save(out, out_file)
    dist.barrier()
    dist.destroy_process_group()


def run(seed, mesh_shape):
    with tempfile.TemporaryDirectory() as d:
        out_file = os.path.join(d, "out.pt")
        n = mesh_shape[0] * (mesh_shape[1] if len(mesh_shape) == 2 else 1)
        mp.spawn(worker, args=(seed, os.path.join(d, "init"), out_file, mesh_shape), nprocs=n)
        return torch.load(out_file)


def check_muon(got, seed):
    xs, ys = data(seed)
    torch.manual_seed(seed)
    model = Odd()
    losses, want = muon_reference.train(model, muon_names(model), xs, ys, aux_lr=3e-4, **HYPER)
    assert got["muon_losses"] == pytest.approx(losses, rel=1e-5), seed
    for n, w in want.items():
        torch.testing.assert_close(got["muon"][n].double(), w, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: "Muon %s (seed %d): %s" % (n, seed, m))


def test_muon_on_fsdp2_hsdp_parameters_matches_one_device():
    """(Replicate(), Shard(0)) over a 2x2 mesh: 13 rows as 7 + 6 inside each replica."""
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    check_muon(run(seed, (2, 2)), seed)


def test_rfsdp_optimizers_on_fsdp2_parameters_match_one_device():
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    got = run(seed, (WORLD,))
    check_muon(got, seed)
    xs, ys = data(seed)
    for name in ("8bit", "shampoo"):
        w, b = nn.Parameter(torch.zeros(96, 64)), nn.Parameter(torch.zeros(96))
        opt = aligned_optimizer(name, [w, b])
        for g_w, g_b in aligned_grads(seed):
            w.grad, b.grad = g_w, g_b
            opt.step()
        for got_t, want_t in zip(got[name], (w, b)):
            torch.testing.assert_close(got_t, want_t.detach(), rtol=1e-6, atol=1e-7,
                                       msg=lambda m: "%s (seed %d): %s" % (name, seed, m))
    torch.manual_seed(seed)
    model = Odd()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    losses = train_on_slices(model, opt, xs, ys, 0, 1)
    assert got["adamw_losses"] == pytest.approx(losses, rel=1e-5), seed
    for n, p in model.named_parameters():
        torch.testing.assert_close(got["adamw"][n], p.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: "AdamW %s (seed %d): %s" % (n, seed, m))
