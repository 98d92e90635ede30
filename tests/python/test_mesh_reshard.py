"""Checkpoints across mesh shapes: the tensor-parallel block (tp_model.py: torch's
ColwiseParallel / RowwiseParallel over mesh["tp"], torch FSDP2 over mesh["dp"])
trained K steps with rfsdp's AdamW and Muon on 4 process ranks, mesh (dp=2, tp=2),
and with AdamW8bit on the block with ColwiseParallel alone (AdamW8bit refuses
RowwiseParallel's column parts today); saved (model and optimizer) through torch
DCP (get_state_dict, as torchtitan saves) and through rfsdp.checkpoint; loaded
into a model built from another seed on (dp=4, tp=1) (plain FSDP2 over a 1-D mesh
of 4), on (dp=1, tp=2) and in one process (no mesh, no process group); K more
steps there.

Claims, per target, optimizer and way of saving: what is read back equals what was
saved, every tensor bit for bit (the model, moments, momentum, 8-bit codes and
block scales: states are moved, never recomputed, and 8-bit ones never
requantised, the settings being the same); the run continued there equals the
uninterrupted (2, 2) run to within 1e-6 (absolute and relative). Not bit for bit:
another mesh sums the gradients in another order (dp slices, the tp partial sums
of RowwiseParallel), so the K steps after the load round differently in float32
(seen: at most 1.5e-7, Muon; 1.2e-7 AdamW). A load that did not happen (the other
seed, fresh states) misses by 0.66."""
import os
import sys

import pytest
import torch

import rfsdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tp_model as tm  # noqa: E402
from ranks import raised, run_ranks  # noqa: E402

K = 2
SEED = 4321
ADAMW = dict(lr=1e-2, weight_decay=0.05)
MUON = dict(lr=0.02, momentum=0.95, weight_decay=0.01)
TOL = 1e-6  # (the module text says why)
OPTS = ("adamw", "muon", "adamw8bit")
HOWS = ("dcp", "rfsdp")
TARGETS = {"dp4_tp1": (4, 1), "dp1_tp2": (1, 2), "one_process": None}


def _optimizer(name, model):
    if name == "adamw":
        return rfsdp.optim.AdamW(model.parameters(), **ADAMW)
    if name == "adamw8bit":  # (every tensor 8-bit; blocks of 64 elements, some cut between ranks)
        return rfsdp.optim.AdamW8bit(model.parameters(), block=64, min_8bit_size=1, **ADAMW)
    named = list(model.named_parameters())
    return rfsdp.optim.Muon(
        [dict(params=[p for n, p in named if n in tm.MATRICES]),
         dict(params=[p for n, p in named if n not in tm.MATRICES], use_muon=False, lr=3e-4)],
        **MUON)


def _colwise_only(model, mesh):
    """tp_model's block with ColwiseParallel alone (qkv and fc1, their outputs
    gathered: proj and fc2 replicated over tp), then FSDP2 over mesh["dp"]: what
    AdamW8bit takes today (it refuses RowwiseParallel's Shard(1))."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    parallelize_module(model, mesh["tp"], {"qkv": ColwiseParallel(output_layouts=Replicate()),
                                           "fc1": ColwiseParallel(output_layouts=Replicate())})
    fully_shard(model, mesh=mesh["dp"])
    return model


def _model(shape, seed, name):
    """The block on mesh shape (dp, tp) (tp 1: FSDP2 over a 1-D mesh of dp), or
    plain (None); with this rank's dp index and dp. AdamW8bit's with ColwiseParallel
    alone."""
    torch.manual_seed(seed)
    model = tm.Block()
    if shape is None:
        return model, 0, 1
    dp, tp = shape
    if tp == 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
        fully_shard(model, mesh=mesh)
        return model, mesh.get_local_rank(), dp
    mesh = tm.mesh_2d(dp, tp)  # (a new mesh each time: torch then mixes in the first one's slices)
    (_colwise_only if name == "adamw8bit" else tm.tensor_parallel)(model, mesh)
    return model, mesh["dp"].get_local_rank(), dp


def _whole(model, opt):
    """The model's parameters and the optimizer's state, every tensor whole, keyed
    by name (collective where sharded; None off rank 0)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    import torch.distributed as dist
    params = tm.full_of(model)
    if dist.is_initialized():
        sd = get_optimizer_state_dict(model, opt, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
        if dist.get_rank() != 0:
            return None
    else:
        sd = get_optimizer_state_dict(model, opt)
    return {"params": params,
            "state": {fqn: {k: t.detach().clone() for k, t in st.items()}
                      for fqn, st in sd["state"].items()}}


def _sd(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    m, o = get_state_dict(model, opt)
    return {"model": m, "optim": o}


def save_worker(rank, world, folder):
    import torch.distributed.checkpoint as dcp
    xs, ys = tm.data(SEED, 2 * K)
    out = {}
    for name in OPTS:
        model, dpr, dp = _model((2, 2), SEED, name)
        opt = _optimizer(name, model)
        tm.train(model, opt, xs[:K], ys[:K], dpr, dp)
        dcp.save(_sd(model, opt), checkpoint_id="%s/%s_dcp" % (folder, name))
        rfsdp.checkpoint.save("%s/%s_rfsdp" % (folder, name), model, opt)
        out[name, "saved"] = _whole(model, opt)
        tm.train(model, opt, xs[K:], ys[K:], dpr, dp)
        out[name] = tm.full_of(model)
    # A model on a mesh built after others of its shape (each _model's): torch gives
    # it some of the first mesh's slices; the optimizer takes it as one mesh.
    out["later_mesh"] = raised(_optimizer, "adamw8bit", _model((2, 2), SEED, "adamw8bit")[0])
    return out


def load_worker(rank, world, folder, shape):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    xs, ys = tm.data(SEED, 2 * K)
    out = {}
    for name in OPTS:
        for how in HOWS:
            model, dpr, dp = _model(shape, SEED + 1, name)  # (other values: the load must replace them)
            opt = _optimizer(name, model)
            path = "%s/%s_%s" % (folder, name, how)
            if how == "dcp":
                sd = _sd(model, opt)
                dcp.load(sd, checkpoint_id=path)
                set_state_dict(model, opt, model_state_dict=sd["model"],
                               optim_state_dict=sd["optim"])
            else:
                rfsdp.checkpoint.load(path, model, opt)
            out[name, how, "loaded"] = _whole(model, opt)
            tm.train(model, opt, xs[K:], ys[K:], dpr, dp)
            out[name, how] = tm.full_of(model)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"saved": rank 0's results on (2, 2), target: rank 0's results there,
    "folder": the checkpoints}."""
    folder = str(tmp_path_factory.mktemp("mesh_reshard"))
    got = {"saved": run_ranks(save_worker, 4, folder)[0], "folder": folder}
    for target, shape in TARGETS.items():
        if shape is None:
            got[target] = load_worker(0, 1, folder, None)
        else:
            got[target] = run_ranks(load_worker, shape[0] * shape[1], folder, shape)[0]
    return got


def _equal(got, want, what):
    assert set(got) == set(want), what
    for k, w in want.items():
        if isinstance(w, dict):
            _equal(got[k], w, "%s %s" % (what, k))
        else:
            g = got[k]
            assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), \
                "%s %s: %s" % (what, k, (g.double() - w.double()).abs().max())


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("name", OPTS)
@pytest.mark.parametrize("target", TARGETS)
def test_the_checkpoint_read_back_equals_the_saved_bit_for_bit(runs, target, name, how):
    _equal(runs[target][name, how, "loaded"], runs["saved"][name, "saved"],
           "%s saved on (2, 2), %s, read on %s:" % (name, how, target))


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("name", OPTS)
@pytest.mark.parametrize("target", TARGETS)
def test_the_run_continued_on_another_mesh_equals_the_uninterrupted(runs, target, name, how):
    want = runs["saved"][name]
    got = runs[target][name, how]
    assert set(got) == set(want)
    for n, w in want.items():
        torch.testing.assert_close(got[n].double(), w.double(), rtol=TOL, atol=TOL,
                                   msg=lambda m: "%s, %s, on %s: %s %s" % (name, how, target, n, m))


def _load_8bit_in_one_process(runs, block):
    torch.manual_seed(SEED + 1)
    model = tm.Block()
    opt = rfsdp.optim.AdamW8bit(model.parameters(), block=block, min_8bit_size=1, **ADAMW)
    rfsdp.checkpoint.load(runs["folder"] + "/adamw8bit_rfsdp", model, opt, requantize=True)
    return model, opt


def test_8bit_states_are_requantised_where_the_block_changed(runs):
    """Saved with 64-element blocks on (2, 2), loaded in one process with 32 and
    requantize=True: every 8-bit state is the saved one decoded (block 64) and
    encoded again with block 32, code for code and scale for scale."""
    model, opt = _load_8bit_in_one_process(runs, 32)
    saved = runs["saved"]["adamw8bit", "saved"]["state"]
    for n, p in model.named_parameters():
        for codes, scale, signed in (("q1", "absmax1", True), ("q2", "absmax2", False)):
            full = rfsdp.quant.dequantize_blockwise(saved[n][codes].reshape(-1),
                                                    saved[n][scale].reshape(-1), block=64,
                                                    signed=signed)
            q, a = rfsdp.quant.quantize_blockwise(full, block=32, signed=signed,
                                                  keep_nonzero=not signed)
            assert torch.equal(opt.state[p][codes].reshape(-1), q.reshape(-1)), (n, codes)
            assert torch.equal(opt.state[p][scale].reshape(-1), a.reshape(-1)), (n, scale)


def test_8bit_states_are_not_requantised_where_the_settings_are_the_same(runs):
    """requantize=True with the saved settings: the codes and scales as saved."""
    model, opt = _load_8bit_in_one_process(runs, 64)
    saved = runs["saved"]["adamw8bit", "saved"]["state"]
    for n, p in model.named_parameters():
        for k in ("q1", "absmax1", "q2", "absmax2"):
            assert torch.equal(opt.state[p][k].reshape(-1), saved[n][k].reshape(-1)), (n, k)


def test_an_optimizer_takes_a_model_on_a_later_mesh_of_the_same_shape(runs):
    assert runs["saved"]["later_mesh"] is None, runs["saved"]["later_mesh"]
