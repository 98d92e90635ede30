"""rfsdp's optimizers past the 2-D (dp, tp) mesh, against one process:
- HSDP x TP: tp_model's transformer block over a 3-D mesh (dp_replicate=2,
  dp_shard=2, tp=2) as torchtitan builds it (ColwiseParallel / RowwiseParallel
  over mesh["tp"], then torch FSDP2 over mesh["dp_replicate", "dp_shard"]), 8
  process ranks;
- expert parallelism: tp_model's MoE block, its expert stacks [E, H, I]
  Shard(0) over mesh["ep"] and FSDP2 over mesh["dp"] inside each ep group, the
  rest FSDP2 over every rank, mesh (dp=2, ep=2), 4 process ranks;
- expert and tensor parallelism (torchtitan's ExpertTensorParallel): the same
  with each expert's hidden columns cut over tp, mesh (dp=2, ep=2, tp=2), 8
  process ranks.
One run of the ranks per mesh computes every case (processes on a shared CPU are
slow); each test checks one claim of it."""
import os
import sys
import tempfile

import pytest
import torch

import rfsdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tp_model as tm  # noqa: E402
from ranks import raised, run_ranks  # noqa: E402
from test_tensor_parallel import TILED, _one_process_fixed, _same, _step_with  # noqa: E402

STEPS = 3
ADAMW = dict(lr=1e-2, weight_decay=0.05)
MUON = dict(lr=0.02, momentum=0.95, weight_decay=0.01)
SEED = 1234


# ---------------------------------------------------------------- HSDP x TP

def worker_3d(rank, world, seed, folder):
    mesh = tm.mesh_3d()
    dp, ndp = tm.dp_of(mesh, tm.DP_3D)
    xs, ys = tm.data(seed, STEPS)
    out = {}

    def model():
        torch.manual_seed(seed)
        return tm.tensor_parallel(tm.Block(), mesh, dp=tm.DP_3D)

    for name, cls in (("torch_adamw", torch.optim.AdamW), ("adamw", rfsdp.optim.AdamW)):
        m = model()
        opt = cls(m.parameters(), **ADAMW)
        out[name + "_losses"] = tm.train(m, opt, xs, ys, dp, ndp)
        out[name] = tm.full_of(m)

    m = model()
    opt = rfsdp.optim.AdamW(m.parameters(), **ADAMW)
    tm.train(m, opt, xs[:2], ys[:2], dp, ndp)
    out["adamw_resumed"] = tm.resumed_through_dcp(m, opt, xs, ys, dp, ndp, folder + "/adamw")

    # Muon: every matrix whole on one root of its replica's (dp_shard, tp) ranks.
    m = model()
    opt = rfsdp.optim.Muon(tm.muon_groups(m, tm.MATRICES), **MUON)
    out["muon_losses"] = tm.train(m, opt, xs, ys, dp, ndp)
    out["muon"] = tm.full_of(m)
    out["muon_comm_size"] = opt.comm.size()
    out["muon_orthogonalised"] = opt.metrics()["groups"][0]["matrices_orthogonalised"]
    m = model()
    opt = rfsdp.optim.Muon(tm.muon_groups(m, tm.MATRICES), **MUON)
    tm.train(m, opt, xs[:2], ys[:2], dp, ndp)
    out["muon_resumed"] = tm.resumed_through_dcp(m, opt, xs, ys, dp, ndp, folder + "/muon")

    # A NaN in one rank's batch reaches every replica's gradients (FSDP2 reduces
    # across them): every rank refuses the step, nothing changes.
    m = model()
    opt = rfsdp.optim.AdamW(m.parameters(), **ADAMW)
    before = tm.full_of(m)
    x = xs[0][dp:dp + 1].clone()
    if rank == 7:
        x[0, 0, 0] = float("nan")
    m(x).pow(2).mean().backward()
    out["nan"] = raised(opt.step)
    out["nan_unchanged"] = all(torch.equal(before[n], t) for n, t in tm.full_of(m).items())

    # fc1 and fc2 left out of the tp plan: copies on both tp ranks, which Muon beside
    # the tensor-parallel qkv and proj refuses, naming them; a Muon of their own
    # (their (dp_shard) group) steps them.
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    torch.manual_seed(seed)
    m = tm.Block()
    parallelize_module(m, mesh["tp"], {"qkv": ColwiseParallel(), "proj": RowwiseParallel()})
    fully_shard(m, mesh=mesh[tm.DP_3D])
    out["muon_copies"] = raised(rfsdp.optim.Muon, [m.qkv.weight, m.fc1.weight], **MUON)
    out["muon_own"] = raised(rfsdp.optim.Muon, [m.fc1.weight, m.fc2.weight], **MUON)

    # AdamW8bit, Shampoo and SOAP (blocks and tiles the column parts hold whole),
    # given fixed gradients: as one process.
    grads = tm.gradients(seed, STEPS)
    for key, cls, kw in TILED:
        m = model()
        _step_with(m, getattr(rfsdp.optim, cls)(m.parameters(), **kw), grads)
        out["tiled_" + key] = tm.full_of(m)

    # rfsdp.clip_grad_norm_ over the mesh's every dimension.
    m = model()
    torch.nn.functional.mse_loss(m(xs[0][dp:dp + 1]), ys[0][dp:dp + 1]).backward()
    out["clip_norm"] = float(rfsdp.clip_grad_norm_(m, 0.1))
    out["clipped"] = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
    return out


@pytest.fixture(scope="module")
def got3d():
    with tempfile.TemporaryDirectory() as d:
        return run_ranks(worker_3d, 8, SEED, d)


@pytest.mark.parametrize("key,cls,kw", TILED, ids=[t[0] for t in TILED])
def test_3d_blockwise_and_tiled_optimizers_step_as_one_process(got3d, key, cls, kw):
    # (AdamW8bit bit for bit: element-wise on blocks of the global tensor)
    want, _ = _one_process_fixed(cls, kw)
    for r in range(8):
        for n, w in want.items():
            assert _same(got3d[r]["tiled_" + key][n], w, key == "8bit"), \
                (cls, r, n, (got3d[r]["tiled_" + key][n] - w).abs().max())


def _one_process(module, opt_of):
    return tm.one_process(module, opt_of, SEED, STEPS)


def _close(got, want, what, tol=1e-6):
    assert sorted(got) == sorted(want), what
    tm.assert_close_all(got, want, what, tol)


def _adamw(m):
    return torch.optim.AdamW(m.parameters(), **ADAMW)


def test_3d_torch_adamw_matches_one_process(got3d):
    _, want = _one_process(tm.Block, _adamw)
    for r in range(8):
        _close(got3d[r]["torch_adamw"], want, "torch AdamW, rank %d" % r)


def test_3d_adamw_matches_one_process(got3d):
    losses, want = _one_process(tm.Block, _adamw)
    assert got3d[0]["adamw_losses"] == pytest.approx(losses, rel=1e-6)
    for r in range(8):
        _close(got3d[r]["adamw"], want, "rfsdp AdamW, rank %d" % r)


def test_3d_adamw_resumed_through_dcp_continues_as_uninterrupted(got3d):
    for r in range(8):
        _close(got3d[r]["adamw_resumed"], got3d[r]["adamw"], "resumed, rank %d" % r, tol=0)


def test_3d_muon_matches_float64_one_device(got3d):
    losses, want = tm.muon_float64(tm.Block, tm.MATRICES, SEED, STEPS, **MUON)
    assert got3d[0]["muon_losses"] == pytest.approx(losses, rel=1e-5)
    for r in range(8):
        _close(got3d[r]["muon"], want, "Muon, rank %d" % r, tol=1e-5)


def test_3d_muon_resumed_through_dcp_continues_as_uninterrupted(got3d):
    for r in range(8):
        _close(got3d[r]["muon_resumed"], got3d[r]["muon"], "Muon resumed, rank %d" % r, tol=0)


def test_3d_muon_roots_each_matrix_once_per_replica_over_its_shard_and_tp_ranks(got3d):
    # (replicas step alike from the same reduced gradients: nothing crosses them)
    for r in range(8):
        assert got3d[r]["muon_comm_size"] == 4
        assert got3d[r]["muon_orthogonalised"] == len(tm.MATRICES)


def test_3d_muon_refuses_a_matrix_copied_over_tp_beside_tensor_parallel_ones(got3d):
    for r in range(8):
        cls, msg = got3d[r]["muon_copies"]
        assert "ValueError" in cls and "param 1" in msg and "Shard(dim=0)" in msg \
            and "sharded over 2 of the 4 ranks" in msg and "a Muon of their own" in msg, msg
        assert got3d[r]["muon_own"] is None, got3d[r]["muon_own"]


def test_3d_nonfinite_gradient_is_refused_on_every_rank(got3d):
    for r in range(8):
        cls, msg = got3d[r]["nan"]
        assert "RuntimeError" in cls and "NaN or Inf" in msg and "not taken on any rank" in msg, msg
        assert got3d[r]["nan_unchanged"]


def test_3d_clip_grad_norm_is_global_over_every_mesh_dimension(got3d):
    xs, ys = tm.data(SEED, STEPS)
    torch.manual_seed(SEED)
    model = tm.Block().double()
    torch.nn.functional.mse_loss(model(xs[0].double()), ys[0].double()).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    for r in range(8):
        assert got3d[r]["clip_norm"] == pytest.approx(norm.item(), rel=1e-5)
        _close(got3d[r]["clipped"], {n: p.grad for n, p in model.named_parameters()},
               "clipped grad, rank %d" % r, tol=1e-6)


# ------------------------------------------------------- expert parallelism

EP_TILED = (("8bit", "AdamW8bit", dict(lr=1e-2, weight_decay=0.05, block=16,
                                        min_8bit_size=1)),  # (3 blocks an expert)
            ) + TILED[1:]  # (Shampoo and SOAP: tiles of 4)


def worker_ep(rank, world, seed, folder):
    mesh = tm.mesh_ep()
    xs, ys = tm.data(seed, STEPS)
    out = {}

    def model(expert_dim=0):
        torch.manual_seed(seed)
        return tm.expert_parallel(tm.MoE(), mesh, expert_dim)

    for name, cls in (("torch_adamw", torch.optim.AdamW), ("adamw", rfsdp.optim.AdamW)):
        m = model()
        opt = cls(m.parameters(), **ADAMW)
        out[name + "_losses"] = tm.train(m, opt, xs, ys, rank, world)
        out[name] = tm.full_of(m)

    # Muon on the expert stacks and the router: each expert whole on one rank.
    m = model()
    opt = rfsdp.optim.Muon(tm.muon_groups(m, tm.EXPERT_STACKS + ("router.weight",)), **MUON)
    out["muon_losses"] = tm.train(m, opt, xs, ys, rank, world)
    out["muon"] = tm.full_of(m)
    # The experts alone: orthogonalised where they lie, nothing gathered.
    m = model()
    opt = rfsdp.optim.Muon(tm.muon_groups(m, tm.EXPERT_STACKS), **MUON)
    tm.train(m, opt, xs[:1], ys[:1], rank, world)
    out["experts_sent"] = opt._impl.gather_send_elems()
    out["experts_orthogonalised"] = opt.metrics()["groups"][0]["matrices_orthogonalised"]

    # AdamW8bit, Shampoo and SOAP given fixed gradients: blocks and tiles of the
    # global stacks (each expert whole on a rank here).
    for key, cls, kw in EP_TILED:
        m = model()
        opt = getattr(rfsdp.optim, cls)(m.parameters(), **kw)
        _step_with(m, opt, tm.gradients(seed, STEPS, tm.MoE))
        out[key] = tm.full_of(m)
    # AdamW saved on (dp=2, ep=2) after 2 steps by rfsdp.checkpoint, for one process.
    m = model()
    opt = rfsdp.optim.AdamW(m.parameters(), **ADAMW)
    tm.train(m, opt, xs[:2], ys[:2], rank, world)
    rfsdp.checkpoint.save(folder + "/ep", m, opt)

    # Experts FSDP2-sharded along dim 1 (torchtitan's choice where dp x ep exceeds
    # the experts): AdamW steps the pieces; Muon refuses them, naming the placement.
    m = model(expert_dim=1)
    out["dim1_placements"] = str(tuple(m.experts.w1.placements))
    opt = rfsdp.optim.AdamW(m.parameters(), **ADAMW)
    tm.train(m, opt, xs, ys, rank, world)
    out["adamw_dim1"] = tm.full_of(m)
    out["muon_dim1"] = raised(rfsdp.optim.Muon, tm.muon_groups(m, tm.EXPERT_STACKS), **MUON)
    return out


@pytest.fixture(scope="module")
def gotep_and_folder():
    with tempfile.TemporaryDirectory() as d:
        yield run_ranks(worker_ep, 4, SEED, d), d


@pytest.fixture(scope="module")
def gotep(gotep_and_folder):
    return gotep_and_folder[0]


@pytest.mark.parametrize("key,cls,kw", EP_TILED, ids=[t[0] for t in EP_TILED])
def test_ep_blocks_and_tiles_per_expert_match_one_process(gotep, key, cls, kw):
    model, _ = tm.one_process_fixed(
        tm.MoE, lambda m: getattr(rfsdp.optim, cls)(m.parameters(), **kw), SEED, STEPS)
    for r in range(4):
        for n, p in model.named_parameters():
            assert _same(gotep[r][key][n], p.detach(), key == "8bit"), (key, r, n)


def test_ep_checkpoint_loads_into_one_process_and_goes_on(gotep_and_folder):
    got, folder = gotep_and_folder
    _, want = _one_process(tm.MoE, _adamw)
    got_on = tm.resumed_in_one_process(
        tm.MoE, lambda m: rfsdp.optim.AdamW(m.parameters(), **ADAMW), folder + "/ep", SEED, STEPS)
    _close(got_on, want, "EP resumed")


def test_ep_torch_adamw_matches_one_process(gotep):
    _, want = _one_process(tm.MoE, _adamw)
    for r in range(4):
        _close(gotep[r]["torch_adamw"], want, "torch AdamW (EP), rank %d" % r)


def test_ep_adamw_matches_one_process(gotep):
    losses, want = _one_process(tm.MoE, _adamw)
    assert gotep[0]["adamw_losses"] == pytest.approx(losses, rel=1e-6)
    for r in range(4):
        _close(gotep[r]["adamw"], want, "rfsdp AdamW (EP), rank %d" % r)


def test_ep_muon_per_expert_matches_float64_one_device(gotep):
    losses, want = tm.muon_float64(tm.MoE, list(tm.EXPERT_STACKS) + ["router.weight"], SEED,
                                   STEPS, **MUON)
    assert gotep[0]["muon_losses"] == pytest.approx(losses, rel=1e-5)
    for r in range(4):
        _close(gotep[r]["muon"], want, "Muon (EP), rank %d" % r, tol=1e-5)


def test_ep_muon_orthogonalises_each_expert_where_it_lies_sending_nothing(gotep):
    total = sum(g["experts_sent"] for g in gotep)
    assert total == 0, [g["experts_sent"] for g in gotep]
    assert gotep[0]["experts_orthogonalised"] == 2 * tm.EXPERTS


def test_ep_adamw_on_experts_sharded_along_dim_1_matches_one_process(gotep):
    assert "Shard(dim=1)" in gotep[0]["dim1_placements"], gotep[0]["dim1_placements"]
    _, want = _one_process(tm.MoE, _adamw)
    for r in range(4):
        _close(gotep[r]["adamw_dim1"], want, "rfsdp AdamW (EP, dim 1), rank %d" % r)


def test_ep_muon_refuses_experts_sharded_along_dim_1_naming_the_placement(gotep):
    for r in range(4):
        cls, msg = gotep[r]["muon_dim1"]
        assert "ValueError" in cls and "expert stack (4, 8, 6)" in msg \
            and "Shard(dim=1)" in msg and "along dim 1" in msg and "rfsdp.optim.AdamW" in msg, msg


# ------------------------------------ expert and tensor parallelism (dp, ep, tp)

def worker_ep_tp(rank, world, seed):
    mesh = tm.mesh_ep(tp=2)
    dp, ndp = tm.dp_of(mesh, ("dp", "ep"))
    xs, ys = tm.data(seed, STEPS)
    out = {}
    for name, cls in (("torch_adamw", torch.optim.AdamW), ("adamw", rfsdp.optim.AdamW)):
        torch.manual_seed(seed)
        m = tm.expert_parallel(tm.MoE(), mesh)
        opt = cls(m.parameters(), **ADAMW)
        out[name + "_losses"] = tm.train(m, opt, xs, ys, dp, ndp)
        out[name] = tm.full_of(m)
    out["placements"] = str(tuple(m.experts.w1.placements))
    # Each expert's columns cut over tp: Muon refuses, naming the placement.
    out["muon"] = raised(rfsdp.optim.Muon, tm.muon_groups(m, tm.EXPERT_STACKS), **MUON)
    return out


@pytest.fixture(scope="module")
def gotet():
    return run_ranks(worker_ep_tp, 8, SEED)


def test_ep_tp_torch_adamw_matches_one_process(gotet):
    _, want = _one_process(tm.MoE, _adamw)
    for r in range(8):
        _close(gotet[r]["torch_adamw"], want, "torch AdamW (EP x TP), rank %d" % r)


def test_ep_tp_adamw_matches_one_process(gotet):
    losses, want = _one_process(tm.MoE, _adamw)
    assert gotet[0]["adamw_losses"] == pytest.approx(losses, rel=1e-6)
    for r in range(8):
        _close(gotet[r]["adamw"], want, "rfsdp AdamW (EP x TP), rank %d" % r)


def test_ep_tp_muon_refuses_experts_cut_by_tp_naming_the_placement(gotet):
    assert "Shard(dim=2)" in gotet[0]["placements"], gotet[0]["placements"]
    for r in range(8):
        cls, msg = gotet[r]["muon"]
        assert "ValueError" in cls and "expert stack (4, 8, 6)" in msg \
            and "Shard(dim=2)" in msg and "along dim 2" in msg and "rfsdp.optim.AdamW" in msg, msg
