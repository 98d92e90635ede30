"""rfsdp's optimizers on parameters sharded by torch's FSDP2 (DTensor Shard(0),
torch.chunk rows), 3 ranks (processes, Gloo), rows that 3 does not divide (the
last rank short; a 3-row matrix gives each rank one row): Muon against the
float64 single-device Muon (muon_reference.py) on the whole batch, AdamW
against torch's AdamW unsharded; AdamW8bit and Shampoo where the chunks hold
whole blocks and tiles against the same optimizer in one process; Shampoo and SOAP (float32
and 8-bit moments) where the chunks cut rows of tiles (owned by the rank holding the first
row) against one process; AdamW8bit where the chunks cut blocks (the ranks agree the shared
blocks' scales), bit for bit against one process, codes and scales included,
under FSDP and HSDP; its state saved by rfsdp.checkpoint on 3 ranks, loaded on
2, resuming as one process; placements rfsdp does not take are refused
naming the parameter and the placement."""
import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

import rfsdp
from torch.distributed.tensor import Replicate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import muon_reference  # noqa: E402
from slice_training import train_on_slices  # noqa: E402
from ranks import run_ranks  # noqa: E402

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


# Chunks that cut blocks: (300, 40) in 100-row chunks (4000 elements, mid-block)
# or 150 (HSDP), (13, 64) as 5, 5, 3 rows (or 7, 6); (70, 45) under 32 x 32 tiles.
CUT = {256: [(300, 40), (13, 64)], (32, 32): [(70, 45), (13, 64)]}


def cut_grads(seed, shapes):
    g = torch.Generator().manual_seed(seed + 23)
    return [[torch.randn(s, generator=g) for s in shapes] for _ in range(STEPS)]


# Shampoo where the chunks cut rows of 8-row tiles: (13, 20) as 5, 5, 3 rows and
# (30, 9) as 10 a rank, an expert stack (3, 10, 6) (whole experts a rank), a bias.
CUT_SHAMPOO = [(13, 20), (30, 9), (3, 10, 6), (13,)]


def shampoo_of(params):
    return rfsdp.optim.Shampoo(params, lr=1e-2, betas=(0.9, 0.95), epsilon=1e-6,
                               max_preconditioner_dim=8, precondition_frequency=2,
                               start_preconditioning_step=2, weight_decay=0.01)


def soap_of(params, state_dtype=torch.float32):
    return rfsdp.optim.SOAP(params, lr=1e-2, betas=(0.9, 0.95), max_preconditioner_dim=8,
                            precondition_frequency=2, weight_decay=0.01, state_dtype=state_dtype)


def soap_8bit_of(params):
    return soap_of(params, "int8")


CUT_TILED = {"Shampoo": shampoo_of, "SOAP": soap_of, "SOAP 8-bit moments": soap_8bit_of}


def cut_tiled(mesh, seed):
    """Shampoo and SOAP over FSDP2 parameters whose chunks cut their tiles, given
    gradients: the full parameters after STEPS steps, by optimizer."""
    from torch.distributed.tensor import Shard, distribute_tensor
    out = {}
    for name, make in CUT_TILED.items():
        ps = [nn.Parameter(distribute_tensor(torch.zeros(s), mesh, [Shard(0)]))
              for s in CUT_SHAMPOO]
        opt = make(ps)
        assert opt.shared_tile_rows() > 0
        for gs in cut_grads(seed, CUT_SHAMPOO):
            for p, g in zip(ps, gs):
                p.grad = distribute_tensor(g, mesh, [Shard(0)])
            opt.step()
        out[name] = [p.full_tensor() for p in ps]
    return out


def check_cut_tiled(got, seed):
    for name, make in CUT_TILED.items():
        ps = [nn.Parameter(torch.zeros(s)) for s in CUT_SHAMPOO]
        opt = make(ps)
        for gs in cut_grads(seed, CUT_SHAMPOO):
            for p, g in zip(ps, gs):
                p.grad = g
            opt.step()
        for got_t, p in zip(got[name], ps):
            torch.testing.assert_close(got_t, p.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: "%s %s (seed %d): %s"
                                       % (name, tuple(p.shape), seed, m))


def cut_8bit(mesh, seed, state_format="dynamic"):
    """AdamW8bit (codes of state_format) over FSDP2 parameters whose chunks cut its
    blocks, on given gradients: every rank's full parameters, and every rank's
    states and spans."""
    from torch.distributed.tensor import Shard, distribute_tensor
    placements = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]
    out = {}
    for block, shapes in CUT.items():
        ps = [nn.Parameter(distribute_tensor(torch.zeros(s), mesh, placements)) for s in shapes]
        opt = rfsdp.optim.AdamW8bit(ps, lr=1e-2, block=block, min_8bit_size=256,
                                    state_format=state_format)
        assert opt.shared_blocks() > 0
        for gs in cut_grads(seed, shapes):
            for p, g in zip(ps, gs):
                p.grad = distribute_tensor(g, mesh, placements)
            opt.step()
        mine = [({k: t.clone() for k, t in opt.sharded_state(p).items()}, opt.state_layout(p),
                 rfsdp.fsdp.dtensor.info_of("p", p).row_begin) for p in ps]
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        out[block] = ([p.full_tensor() for p in ps], every)
    return out


def check_cut_8bit(got, seed, state_format="dynamic"):
    """Parameters, codes (each rank's rows) and scales (each rank's blocks, shared
    ones on every rank that holds part of them) equal one process's, bit for bit."""
    for block, shapes in CUT.items():
        ps = [nn.Parameter(torch.zeros(s)) for s in shapes]
        opt = rfsdp.optim.AdamW8bit(ps, lr=1e-2, block=block, min_8bit_size=256,
                                    state_format=state_format)
        for gs in cut_grads(seed, shapes):
            for p, g in zip(ps, gs):
                p.grad = g
            opt.step()
        params, every = got[block]
        for i, p in enumerate(ps):
            assert torch.equal(params[i], p.detach()), (block, shapes[i], seed)
            whole = opt.sharded_state(p)
            for rank, states in enumerate(every):
                st, spans, row_begin = states[i]
                row_len = shapes[i][1]
                for name in ("q1", "q2"):
                    n = st[name].numel()
                    assert spans[name] == ("sequence", whole[name].numel(), row_begin * row_len, 0, ())
                    want = whole[name][row_begin * row_len:row_begin * row_len + n]
                    assert torch.equal(st[name], want), (block, shapes[i], rank, name, seed)
                for name in ("absmax1", "absmax2"):
                    _, total, first, shared, runs = spans[name]
                    assert runs == ()
                    assert total == whole[name].numel()
                    want = whole[name][first:first + st[name].numel()]
                    assert torch.equal(st[name], want), (block, shapes[i], rank, name, seed)


def worker(rank, world, seed, mesh_shape=(WORLD,)):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
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
    out["cut_8bit"] = cut_8bit(mesh, seed)
    if len(mesh_shape) == 2:  # HSDP: Muon and cut-block AdamW8bit
        return out if rank == 0 else None

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
    out["cut_tiled"] = cut_tiled(mesh, seed)

    # Placements rfsdp's optimizers do not take: refused, naming both.
    # (7 columns: unequal column pieces; equal ones are column parts, which Muon takes)
    w = nn.Parameter(distribute_tensor(torch.randn(6, 7), mesh, [Shard(1)]))
    with pytest.raises(ValueError, match=r"param 0.*Shard\(dim=1\)"):
        rfsdp.optim.Muon([w])
    # A DTensor replicated along every dim (a tensor-parallel bias) is a whole tensor
    # on each rank, stepped alike, as torch's AdamW steps it (every rank's piece).
    gen = torch.Generator().manual_seed(seed)
    r = nn.Parameter(distribute_tensor(torch.randn(6, 6, generator=gen), mesh, [Replicate()]))
    opt = rfsdp.optim.AdamW([r], lr=1e-2, weight_decay=0.05)
    for _ in range(2):
        r.grad = distribute_tensor(torch.randn(6, 6, generator=gen), mesh, [Replicate()])
        opt.step()
    out["replicated"] = r.to_local().detach().clone()
    return out if rank == 0 else None


def run(seed, mesh_shape):
    n = mesh_shape[0] * (mesh_shape[1] if len(mesh_shape) == 2 else 1)
    return run_ranks(worker, n, seed, mesh_shape)[0]


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
    got = run(seed, (2, 2))
    check_muon(got, seed)
    check_cut_8bit(got["cut_8bit"], seed)


def test_rfsdp_optimizers_on_fsdp2_parameters_match_one_device():
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    got = run(seed, (WORLD,))
    check_muon(got, seed)
    check_cut_8bit(got["cut_8bit"], seed)
    check_cut_tiled(got["cut_tiled"], seed)
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
    gen = torch.Generator().manual_seed(seed)
    r = nn.Parameter(torch.randn(6, 6, generator=gen))
    opt = torch.optim.AdamW([r], lr=1e-2, weight_decay=0.05)
    for _ in range(2):
        r.grad = torch.randn(6, 6, generator=gen)
        opt.step()
    torch.testing.assert_close(got["replicated"], r.detach(), rtol=1e-6, atol=1e-7)
    torch.manual_seed(seed)
    model = Odd()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    losses = train_on_slices(model, opt, xs, ys, 0, 1)
    assert got["adamw_losses"] == pytest.approx(losses, rel=1e-5), seed
    for n, p in model.named_parameters():
        torch.testing.assert_close(got["adamw"][n], p.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: "AdamW %s (seed %d): %s" % (n, seed, m))


# ---- optimizer state of an FSDP2 model through rfsdp.checkpoint, resharded ----

def ckpt_model(mesh):
    torch.manual_seed(0)
    return fsdp2(Odd(), mesh)


def ckpt_grads(seed, model):
    g = torch.Generator().manual_seed(seed + 31)
    return [{n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
            for _ in range(4)]


def ckpt_optimizer(name, params, save):
    """save: the optimizer that saves (else the one that loads: they differ for
    "soap-fp32-to-int8", whose load requantises the moments)."""
    if name == "8bit":
        return rfsdp.optim.AdamW8bit(params, lr=1e-2, block=32, min_8bit_size=16)
    if name.startswith("soap"):
        state = "int8" if name == "soap8bit" or not save else torch.float32
        return rfsdp.optim.SOAP(params, lr=1e-2, betas=(0.9, 0.95), max_preconditioner_dim=4,
                                precondition_frequency=2, state_dtype=state)
    return rfsdp.optim.Shampoo(params, lr=1e-2, betas=(0.9, 0.95), epsilon=1e-6,
                               max_preconditioner_dim=4, precondition_frequency=2,
                               start_preconditioning_step=2)


def ckpt_worker(rank, world, name, seed, path, save):
    """save: 2 steps on 3 ranks, save, 2 more; load: on 2 ranks, the last 2 steps.
    Given gradients, so each step is the one-device step (AdamW8bit's blocks and
    Shampoo's and SOAP's rows of tiles cut by FSDP2's chunks, differently at 3 and
    2 ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    model = ckpt_model(mesh)
    opt = ckpt_optimizer(name, model.parameters(), save)
    grads = ckpt_grads(seed, model)

    def step(k):
        for n, p in model.named_parameters():
            p.grad = distribute_tensor(grads[k][n], mesh, [Shard(0)])
        opt.step()
    if save:
        assert (opt.shared_blocks() if name == "8bit" else opt.shared_tile_rows()) > 0
        step(0)
        step(1)
        rfsdp.checkpoint.save(path, model, opt)
    else:
        rfsdp.checkpoint.load(path, model, opt, requantize=name == "soap-fp32-to-int8")
    step(2)
    step(3)
    return full_of(model)


@pytest.mark.parametrize("name", ["8bit", "shampoo", "soap8bit", "soap-fp32-to-int8"])
def test_fsdp2_optimizer_state_checkpoint_reshards_and_resumes_as_one_process(name):
    """AdamW8bit: bit for bit; Shampoo, SOAP: to fp32 rounding (roots, rotations).
    SOAP with 8-bit moments: the scales of a cut row of tiles are its owner's (3
    ranks) and another rank's (2); from float32 moments, encoded where loaded."""
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ckpt")
        outs = []
        for world, save in ((3, True), (2, False)):
            outs.append(run_ranks(ckpt_worker, world, name, seed, path, save)[0])
        # one process: the same steps, saved and loaded where the ranks did
        torch.manual_seed(0)
        model = Odd()
        opt = ckpt_optimizer(name, model.parameters(), True)
        for k, grads in enumerate(ckpt_grads(seed, model)):
            if k == 2:
                one = os.path.join(d, "one")
                rfsdp.checkpoint.save(one, model, opt)
                opt = ckpt_optimizer(name, model.parameters(), False)
                rfsdp.checkpoint.load(one, model, opt, requantize=name == "soap-fp32-to-int8")
            for n, p in model.named_parameters():
                p.grad = grads[n]
            opt.step()
    # (fp32-to-int8: the 3 ranks that saved go on in float32; the 2 that loaded are the run)
    runs = list(zip((3, 2), outs))[1 if name == "soap-fp32-to-int8" else 0:]
    for n, p in model.named_parameters():
        for world, got in runs:
            if name == "8bit":
                assert torch.equal(got[n], p.detach()), (n, world, seed)
            else:
                torch.testing.assert_close(got[n], p.detach(), rtol=1e-5, atol=1e-6,
                                           msg=lambda m: "%s, %d ranks (seed %d): %s"
                                           % (n, world, seed, m))
