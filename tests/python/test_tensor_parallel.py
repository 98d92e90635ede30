"""rfsdp's optimizers on a transformer block parallelised as torchtitan does
(torch's ColwiseParallel / RowwiseParallel over mesh["tp"], then torch FSDP2 over
mesh["dp"]): 4 process ranks (Gloo), mesh (dp=2, tp=2), 3 steps, against one
process (tp_model.py; AdamW8bit, Shampoo and SOAP given the same gradients on
both). One run of the ranks computes every case (4 processes on a shared CPU are
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

STEPS = 3
ADAMW = dict(lr=1e-2, weight_decay=0.05)
MUON = dict(lr=0.02, momentum=0.95, weight_decay=0.01)
SEED = 1234


def _dp_rank(mesh):
    return mesh["dp"].get_local_rank()


def _model(mesh, seed):
    torch.manual_seed(seed)
    return tm.tensor_parallel(tm.Block(), mesh)


# The optimizers whose state is blocks or tiles of the global tensor, with blocks
# and tiles that RowwiseParallel's column parts (proj: 4 columns, fc2: 8) hold
# whole; each given the same gradients on the mesh and on one process.
EIGHT_BIT = dict(lr=1e-2, weight_decay=0.05, block=4, min_8bit_size=1)
SHAMPOO = dict(lr=1e-2, max_preconditioner_dim=4, precondition_frequency=1,
               start_preconditioning_step=1)
SOAP = dict(lr=1e-2, max_preconditioner_dim=4, precondition_frequency=1)
TILED = (("8bit", "AdamW8bit", EIGHT_BIT), ("shampoo", "Shampoo", SHAMPOO),
         ("soap", "SOAP", SOAP))


def _step_with(model, opt, grads):
    """opt's steps with these full gradients, each rank given its piece of them."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    for g in grads:
        for n, p in model.named_parameters():
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh,
                                                                  p.placements)
            piece = g[n][tuple(slice(o, o + k) for o, k in zip(offset, shape))].contiguous()
            p.grad = DTensor.from_local(piece, p.device_mesh, p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride())
        opt.step()


def worker(rank, world, seed, folder):
    from torch.distributed.tensor import DTensor
    mesh = tm.mesh_2d()
    dp = _dp_rank(mesh)
    xs, ys = tm.data(seed, STEPS)
    out = {}

    # torch's AdamW on the 2-D model (the baseline) and rfsdp's.
    for name, cls in (("torch_adamw", torch.optim.AdamW), ("adamw", rfsdp.optim.AdamW)):
        model = _model(mesh, seed)
        opt = cls(model.parameters(), **ADAMW)
        out[name + "_losses"] = tm.train(model, opt, xs, ys, dp, 2)
        out[name] = tm.full_of(model)

    # AdamW's state dict: DTensors with the parameters' placements; through DCP
    # (saved after 2 steps, the states zeroed, loaded) the run goes on as before.
    model = _model(mesh, seed)
    opt = rfsdp.optim.AdamW(model.parameters(), **ADAMW)
    tm.train(model, opt, xs[:2], ys[:2], dp, 2)
    sd = opt.state_dict()
    params = list(model.parameters())
    out["state_placements"] = [
        (tuple(sd["state"][i][k].placements) == tuple(p.placements)
         and isinstance(sd["state"][i][k], DTensor)
         and tuple(sd["state"][i][k].shape) == tuple(p.shape))
        for i, p in enumerate(params) for k in ("exp_avg", "exp_avg_sq")]
    out["adamw_resumed"] = tm.resumed_through_dcp(model, opt, xs, ys, dp, 2, folder + "/adamw")

    # A NaN in one rank's gradient: every rank refuses the step, nothing changes.
    model = _model(mesh, seed)
    opt = rfsdp.optim.AdamW(model.parameters(), **ADAMW)
    tm.train(model, opt, xs[:1], ys[:1], dp, 2)
    before = tm.full_of(model)
    model(xs[1][:2]).pow(2).mean().backward()
    if rank == 3:
        model.proj.weight.grad._local_tensor[0, 0] = float("nan")
    out["nan"] = raised(opt.step)
    out["nan_unchanged"] = all(torch.equal(before[n], t) for n, t in tm.full_of(model).items())

    # Muon on every matrix: ColwiseParallel's rows and RowwiseParallel's column
    # parts, each matrix whole on one root.
    model = _model(mesh, seed)
    opt = rfsdp.optim.Muon(tm.muon_groups(model), **MUON)
    out["muon_losses"] = tm.train(model, opt, xs, ys, dp, 2)
    out["muon"] = tm.full_of(model)
    model = _model(mesh, seed)
    opt = rfsdp.optim.Muon(tm.muon_groups(model), **MUON)
    tm.train(model, opt, xs[:2], ys[:2], dp, 2)
    out["muon_resumed"] = tm.resumed_through_dcp(model, opt, xs, ys, dp, 2, folder + "/muon")

    # AdamW8bit, Shampoo and SOAP on every parameter (column parts included), given
    # fixed gradients: parameters and (gathered whole) states as one process's.
    grads = tm.gradients(seed, STEPS)
    for key, cls, kw in TILED:
        model = _model(mesh, seed)
        opt = getattr(rfsdp.optim, cls)(model.parameters(), **kw)
        _step_with(model, opt, grads)
        out[key] = tm.full_of(model)
        rfsdp.set_state_dict_type(opt, "full", rank0_only=False)
        out[key + "_state"] = opt.state_dict()["state"]
    # Their states (codes, scales, per-tile sequences: runs of the global sequences
    # on the column parts) through rfsdp.checkpoint into a fresh model and
    # optimizer after 2 steps, and AdamW8bit's through DCP (saved, zeroed,
    # loaded): the run goes on as the uninterrupted one.
    for key, cls, kw in TILED:
        model = _model(mesh, seed)
        opt = getattr(rfsdp.optim, cls)(model.parameters(), **kw)
        tm.train(model, opt, xs, ys, dp, 2)
        out[key + "_trained"] = tm.full_of(model)
        model = _model(mesh, seed)
        opt = getattr(rfsdp.optim, cls)(model.parameters(), **kw)
        tm.train(model, opt, xs[:2], ys[:2], dp, 2)
        rfsdp.checkpoint.save(folder + "/ck_" + key, model, opt)
        if key == "8bit":
            out["8bit_resumed"] = tm.resumed_through_dcp(model, opt, xs, ys, dp, 2,
                                                         folder + "/8bit")
        model = _model(mesh, seed)
        opt = getattr(rfsdp.optim, cls)(model.parameters(), **kw)
        rfsdp.checkpoint.load(folder + "/ck_" + key, model, opt)
        tm.train(model, opt, xs[2:], ys[2:], dp, 2)
        out[key + "_loaded"] = tm.full_of(model)
    # Blocks and tiles that the column parts would cut: refused.
    model = _model(mesh, seed)
    out["8bit_cut"] = raised(rfsdp.optim.AdamW8bit, model.named_parameters(), min_8bit_size=1)
    out["shampoo_cut"] = raised(rfsdp.optim.Shampoo, model.named_parameters(),
                                 max_preconditioner_dim=8)

    # rfsdp.clip_grad_norm_ over the mesh's every dimension.
    model = _model(mesh, seed)
    x, y = xs[0][dp * 2:dp * 2 + 2], ys[0][dp * 2:dp * 2 + 2]
    torch.nn.functional.mse_loss(model(x), y).backward()
    out["clip_norm"] = float(rfsdp.clip_grad_norm_(model, 0.1))
    out["clipped"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return out


@pytest.fixture(scope="module")
def got():
    with tempfile.TemporaryDirectory() as d:
        return run_ranks(worker, 4, SEED, d)


def _one_process(opt_of):
    return tm.one_process(tm.Block, opt_of, SEED, STEPS)


_close = tm.assert_close_all


def test_torch_adamw_on_the_2d_model_matches_one_process(got):
    _, want = _one_process(lambda m: torch.optim.AdamW(m.parameters(), **ADAMW))
    for r in range(4):
        _close(got[r]["torch_adamw"], want, "torch AdamW, rank %d" % r)


def test_adamw_on_the_2d_model_matches_one_process(got):
    losses, want = _one_process(lambda m: torch.optim.AdamW(m.parameters(), **ADAMW))
    assert got[0]["adamw_losses"] == pytest.approx(losses, rel=1e-6)
    for r in range(4):
        _close(got[r]["adamw"], want, "rfsdp AdamW, rank %d" % r)


def test_adamw_on_the_2d_model_matches_torch_adamw_on_it(got):
    _close(got[0]["adamw"], got[0]["torch_adamw"], "rfsdp AdamW vs torch AdamW (2-D)")


def test_adamw_states_are_dtensors_with_the_parameters_placements(got):
    assert all(got[0]["state_placements"]) and all(got[3]["state_placements"])


def test_adamw_resumed_through_dcp_continues_as_uninterrupted(got):
    for r in range(4):
        _close(got[r]["adamw_resumed"], got[r]["adamw"], "resumed, rank %d" % r, tol=0)


def test_muon_resumed_through_dcp_continues_as_uninterrupted(got):
    for r in range(4):
        _close(got[r]["muon_resumed"], got[r]["muon"], "Muon resumed, rank %d" % r, tol=0)


def test_nonfinite_gradient_on_one_rank_is_refused_on_every_rank(got):
    for r in range(4):
        cls, msg = got[r]["nan"]
        assert "RuntimeError" in cls and "NaN or Inf (on rank 3)" in msg \
            and "not taken on any rank" in msg, msg
        assert got[r]["nan_unchanged"]


def test_muon_on_the_2d_model_matches_float64_one_device(got):
    losses, want = tm.muon_float64(tm.Block, tm.MATRICES, SEED, STEPS, **MUON)
    assert got[0]["muon_losses"] == pytest.approx(losses, rel=1e-5)
    for r in range(4):
        _close(got[r]["muon"], want, "Muon, rank %d" % r, tol=1e-5)


def _one_process_fixed(cls, kw):
    """cls on one process given tm.gradients: its parameters and state dict's states."""
    model, opt = tm.one_process_fixed(
        tm.Block, lambda m: getattr(rfsdp.optim, cls)(m.parameters(), **kw), SEED, STEPS)
    return {n: p.detach() for n, p in model.named_parameters()}, opt.state_dict()["state"]


def _same(got, want, exact):
    """Bit for bit (element-wise AdamW8bit: the same operations on the same values),
    or to fp32 rounding (Shampoo's and SOAP's products of tiles that are views of
    differently shaped pieces: measured up to 4e-9 on parameters of ~0.3)."""
    if exact:
        return torch.equal(got, want)
    return torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("key,cls,kw", TILED, ids=[t[0] for t in TILED])
def test_column_parts_step_as_one_process_every_parameter_element(got, key, cls, kw):
    want, _ = _one_process_fixed(cls, kw)
    for r in range(4):
        for n, w in want.items():
            assert _same(got[r][key][n], w, key == "8bit"), \
                (cls, r, n, (got[r][key][n] - w).abs().max())


@pytest.mark.parametrize("key,cls,kw", TILED, ids=[t[0] for t in TILED])
def test_column_parts_states_gathered_whole_equal_one_process_entry_for_entry(got, key, cls, kw):
    # (8-bit codes and scales code for code: blocks of the global tensor; Shampoo's
    # and SOAP's per-tile sequences in the global matrix's tile order)
    _, want = _one_process_fixed(cls, kw)
    for r in (0, 3):
        for i, st in want.items():
            assert set(got[r][key + "_state"][i]) == set(st), (cls, i)
            for name, w in st.items():
                g = got[r][key + "_state"][i][name]
                assert g.shape == w.reshape(-1).shape or g.shape == w.shape, (cls, i, name)
                assert _same(g.reshape(-1), w.reshape(-1), key == "8bit"), \
                    (cls, r, i, name, (g.reshape(-1).double() - w.reshape(-1).double()).abs().max())


@pytest.mark.parametrize("key", [t[0] for t in TILED])
def test_column_parts_states_through_rfsdp_checkpoint_continue_as_uninterrupted(got, key):
    for r in range(4):
        _close(got[r][key + "_loaded"], got[r][key + "_trained"], "%s loaded, rank %d" % (key, r),
               tol=0)


def test_adamw8bit_resumed_through_dcp_continues_as_uninterrupted(got):
    for r in range(4):
        _close(got[r]["8bit_resumed"], got[r]["8bit_trained"], "AdamW8bit resumed, rank %d" % r,
               tol=0)


def test_adamw8bit_refuses_blocks_the_column_parts_cut_naming_what_to_do(got):
    cls, msg = got[0]["8bit_cut"]
    assert "ValueError" in cls, (cls, msg)
    for want in ("'proj.weight'", "2 column parts of 4 columns", "Shard(1)", "1-D blocks of 256",
                 "a block size that divides 4", "rfsdp.optim.AdamW"):
        assert want in msg, (want, msg)


def test_shampoo_refuses_tiles_the_column_parts_cut_naming_what_to_do(got):
    cls, msg = got[0]["shampoo_cut"]
    assert "ValueError" in cls, (cls, msg)
    for want in ("'proj.weight'", "2 column parts of 4 columns", "Shard(1)",
                 "max_preconditioner_dim=8", "divides 4"):
        assert want in msg, (want, msg)


def test_clip_grad_norm_is_global_over_both_mesh_dimensions(got):
    xs, ys = tm.data(SEED, STEPS)
    torch.manual_seed(SEED)
    model = tm.Block().double()
    torch.nn.functional.mse_loss(model(xs[0].double()), ys[0].double()).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    for r in range(4):
        assert got[r]["clip_norm"] == pytest.approx(norm.item(), rel=1e-5)
        _close(got[r]["clipped"], {n: p.grad for n, p in model.named_parameters()},
               "clipped grad, rank %d" % r, tol=1e-6)
