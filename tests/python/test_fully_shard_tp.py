"""rfsdp.fully_shard over tensor-parallel modules (torch's ColwiseParallel /
RowwiseParallel over mesh["tp"] first, as torchtitan does, then
rfsdp.fully_shard(module, mesh=mesh["dp"])): the planner plans each rank's tp
pieces, the collectives run over dp, and the shards present their place in the
global tensor, so every optimizer steps them. 4 process ranks (Gloo), mesh
(dp=2, tp=2), against one process (tp_model.py's block: a fused head-major QKV),
one run of the ranks for every case; each test checks one claim of it. HSDP x
TP (dp_replicate=2, dp_shard=2, tp=2) on 8 ranks, and expert parallelism (an MoE
block's expert stacks Shard(0) over ep, mesh (dp=2, ep=2)): a run each."""
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
SEED = 4321
ADAMW = dict(lr=1e-2, weight_decay=0.05)
MUON = dict(lr=0.02, momentum=0.95, weight_decay=0.01)
# Blocks and tiles RowwiseParallel's column parts (proj: 4 columns, fc2: 8) hold whole.
TILED = (("8bit", "AdamW8bit", dict(lr=1e-2, weight_decay=0.05, block=4, min_8bit_size=1)),
         ("shampoo", "Shampoo", dict(lr=1e-2, max_preconditioner_dim=4, precondition_frequency=1,
                                     start_preconditioning_step=1)),
         ("soap", "SOAP", dict(lr=1e-2, max_preconditioner_dim=4, precondition_frequency=1)))
CLIP = 0.1
EXPERT_BLOCKS = {"experts.w1": [4, 4], "experts.w2": [3, 3]}  # (rows of each [8, 6] / [6, 8] expert)
EP_8BIT = dict(lr=1e-2, weight_decay=0.05, block=16, min_8bit_size=1)


def _model(mesh, seed, dp="dp", policy=None):
    """The block, tensor-parallel, then two rfsdp units over mesh[dp]: the fused
    QKV's own (an inner call) and the rest's."""
    torch.manual_seed(seed)
    model = tm.tensor_parallel(tm.Block(), mesh, dp=None)
    rfsdp.fully_shard(model.qkv, mesh=mesh[dp], policy=policy)
    rfsdp.fully_shard(model, mesh=mesh[dp], policy=policy)
    return model


# Muon per head of the fused QKV ([head][q, k, v][head_dim] rows: 6 blocks), by the
# plan's policy (the outer call finds the blocks under the model's name and plans
# the inner unit again).
HEAD_BLOCKS = {"qkv.weight": [tm.DIM // tm.HEADS] * (3 * tm.HEADS)}


def _piece(full, info):
    """This rank's part of a global tensor, from its ShardInfo's definition: the
    rectangle of a column piece, else rows [row_begin, row_end) of the tensor
    seen as rows of row_len elements."""
    if info.box is not None:
        _, offsets, sizes = info.box
        return full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].reshape(-1)
    return full.reshape(-1, info.row_len)[info.row_begin:info.row_end].reshape(-1)


def _step_with(model, opt, grads):
    for g in grads:
        for n, p in model.named_parameters():
            p.grad = _piece(g[n], rfsdp.shard_info(p)).view(p.shape).clone()
        opt.step()


def _freeze(model):
    model.fc1.weight.requires_grad_(False)
    model.proj.weight.requires_grad_(False)


def _train_freezing(model, opt, xs, ys, dp=0, ndp=1):
    """tm.train's steps, _freeze(model) after the first."""
    losses = tm.train(model, opt, xs[:1], ys[:1], dp, ndp)
    _freeze(model)
    return losses + tm.train(model, opt, xs[1:], ys[1:], dp, ndp)


def worker(rank, world, seed, folder):
    mesh = tm.mesh_2d()
    dp = mesh["dp"].get_local_rank()
    xs, ys = tm.data(seed, STEPS)
    out = {}

    model = _model(mesh, seed)
    out["placements"] = {n: (type(p).__name__, tuple(p.shape), rfsdp.shard_info(p).global_shape,
                             rfsdp.shard_info(p).process_group.size())
                         for n, p in model.named_parameters()}
    opt = rfsdp.optim.AdamW(model.parameters(), **ADAMW)
    out["adamw_losses"] = tm.train(model, opt, xs, ys, dp, 2)
    out["adamw"] = tm.full_of(model)
    rfsdp.set_state_dict_type(model, "full", rank0_only=False)
    out["full_state_dict"] = {k: v.clone() for k, v in model.state_dict().items()}
    # A full state dict loaded into a fresh model: each rank keeps its part.
    fresh = _model(mesh, seed + 1)
    fresh.load_state_dict(out["full_state_dict"])
    out["loaded_full"] = tm.full_of(fresh)

    # An optimizer built on the tensor-parallel parameters before fully_shard (the
    # order accelerate and the Trainer use) follows them to their shards.
    torch.manual_seed(seed)
    model = tm.tensor_parallel(tm.Block(), mesh, dp=None)
    opt = rfsdp.optim.AdamW(model.parameters(), **ADAMW)
    rfsdp.fully_shard(model.qkv, mesh=mesh["dp"])
    rfsdp.fully_shard(model, mesh=mesh["dp"])
    tm.train(model, opt, xs, ys, dp, 2)
    out["adamw_built_before"] = tm.full_of(model)
    # Its sharded state dict through DCP into a fresh model (another seed).
    import torch.distributed.checkpoint as dcp
    dcp.save(model.state_dict(), checkpoint_id=folder + "/model")
    fresh = _model(mesh, seed + 2)
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=folder + "/model")
    fresh.load_state_dict(sd)
    out["dcp_model"] = tm.full_of(fresh)

    # bfloat16 compute (float32 reduce and masters), torch AdamW on both: rfsdp's
    # units beside torch FSDP2's on the same tensor-parallel model (the anchor).
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    for key in ("bf16_fsdp2", "bf16_rfsdp"):
        torch.manual_seed(seed)
        model = tm.tensor_parallel(tm.Block(), mesh, dp=None)
        if key == "bf16_fsdp2":
            fully_shard(model, mesh=mesh["dp"], mp_policy=MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        else:
            rfsdp.fully_shard(model, mesh=mesh["dp"], mp_policy=rfsdp.MixedPrecisionPolicy(
                param_dtype=torch.bfloat16))
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        out[key + "_losses"] = tm.train(model, opt, xs, ys, dp, 2, output=torch.float32)
        out[key] = tm.full_of(model)

    # Gradient accumulation: half the batch with gradient sync off, half with it on,
    # then an SGD step of lr 1: the one-process gradient of the whole batch.
    model = _model(mesh, seed)
    per = xs.shape[1] // 2
    x, y = xs[0][dp * per:(dp + 1) * per], ys[0][dp * per:(dp + 1) * per]
    model.set_requires_gradient_sync(False)
    (torch.nn.functional.mse_loss(model(x[:per // 2]), y[:per // 2]) / 2).backward()
    model.set_requires_gradient_sync(True)
    (torch.nn.functional.mse_loss(model(x[per // 2:]), y[per // 2:]) / 2).backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    out["accumulated_step"] = tm.full_of(model)

    # The block under activation checkpointing (non-reentrant: its forward runs
    # again in backward, gathering its tp pieces again), its unit kept gathered
    # after forward (reshard_after_forward=False).
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = tm.Block()

        def forward(self, x):
            return checkpoint(self.block, x, use_reentrant=False)
    torch.manual_seed(seed)
    model = Checkpointed()
    tm.tensor_parallel(model.block, mesh, dp=None)
    rfsdp.fully_shard(model.block, mesh=mesh["dp"], reshard_after_forward=False)
    rfsdp.fully_shard(model, mesh=mesh["dp"])
    opt = rfsdp.optim.AdamW(model.parameters(), **ADAMW)
    tm.train(model, opt, xs, ys, dp, 2)
    out["checkpointed"] = {n[len("block."):]: t for n, t in tm.full_of(model).items()}

    # requires_grad changed after sharding: fc1.weight (ColwiseParallel rows) and
    # proj.weight (RowwiseParallel column parts) frozen after the first step.
    model = _model(mesh, seed)
    opt = rfsdp.optim.AdamW(model.parameters(), **ADAMW)
    out["frozen_losses"] = _train_freezing(model, opt, xs, ys, dp, 2)
    out["frozen"] = tm.full_of(model)

    # Gradients: clipped over dp and tp, then an SGD step of lr 1 (the parameters
    # move by exactly the clipped gradients).
    model = _model(mesh, seed)
    per = xs.shape[1] // 2
    x, y = xs[0][dp * per:(dp + 1) * per], ys[0][dp * per:(dp + 1) * per]
    torch.nn.functional.mse_loss(model(x), y).backward()
    out["clip_norm"] = float(rfsdp.clip_grad_norm_(model, CLIP))
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    out["clipped_step"] = tm.full_of(model)

    # Muon on every matrix (ColwiseParallel's rows, RowwiseParallel's column parts).
    model = _model(mesh, seed)
    opt = rfsdp.optim.Muon(tm.muon_groups(model), **MUON)
    out["muon_losses"] = tm.train(model, opt, xs, ys, dp, 2)
    out["muon"] = tm.full_of(model)
    # The same saved after 2 steps through DCP (torch's optimizer path), zeroed, loaded.
    model = _model(mesh, seed)
    opt = rfsdp.optim.Muon(tm.muon_groups(model), **MUON)
    tm.train(model, opt, xs[:2], ys[:2], dp, 2)
    out["muon_resumed"] = tm.resumed_through_dcp(model, opt, xs, ys, dp, 2, folder + "/muon")

    # Muon per head: ColwiseParallel keeps whole heads on each tp rank, the plan
    # each block whole on one dp rank, so the step sends nothing for them.
    model = _model(mesh, seed, policy=rfsdp.policy.muon(split=HEAD_BLOCKS))
    opt = rfsdp.optim.Muon(tm.muon_groups(model, names=("qkv.weight",)), **MUON)
    out["heads_losses"] = tm.train(model, opt, xs, ys, dp, 2)
    out["heads"] = tm.full_of(model)
    out["heads_sent"] = opt._impl.gather_send_elems()

    # AdamW8bit, Shampoo, SOAP given fixed gradients.
    grads = tm.gradients(seed, STEPS)
    for key, cls, kw in TILED:
        model = _model(mesh, seed)
        opt = getattr(rfsdp.optim, cls)(model.parameters(), **kw)
        _step_with(model, opt, grads)
        out[key] = tm.full_of(model)

    # rfsdp.checkpoint: AdamW saved on the mesh after 2 steps, loaded into one
    # process (after the ranks are done) to go on from there.
    model = _model(mesh, seed)
    opt = rfsdp.optim.AdamW(model.parameters(), **ADAMW)
    tm.train(model, opt, xs[:2], ys[:2], dp, 2)
    rfsdp.checkpoint.save(folder + "/ck", model, opt)

    # What rfsdp.fully_shard refuses: a tp piece it cannot cut equally, and a
    # process group where the tp mesh's dims are needed.
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
    odd = parallelize_module(torch.nn.Linear(3, 4), mesh["tp"], RowwiseParallel())
    out["uneven"] = raised(rfsdp.fully_shard, odd, mesh=mesh["dp"])
    block = tm.tensor_parallel(tm.Block(), mesh, dp=None)
    out["no_mesh"] = raised(rfsdp.fully_shard, block, process_group=mesh["dp"].get_group())
    return out


@pytest.fixture(scope="module")
def got():
    with tempfile.TemporaryDirectory() as d:
        yield run_ranks(worker, 4, SEED, d), d + "/ck"


def worker_3d(rank, world, seed):
    """HSDP x TP: mesh (dp_replicate=2, dp_shard=2, tp=2), rfsdp.fully_shard over
    the (dp_replicate, dp_shard) dims: AdamW, Muon, the clipping norm."""
    mesh = tm.mesh_3d()
    dp, ndp = tm.dp_of(mesh, tm.DP_3D)
    xs, ys = tm.data(seed, STEPS)
    out = {}
    model = _model(mesh, seed, dp=tm.DP_3D)
    opt = rfsdp.optim.AdamW(model.parameters(), **ADAMW)
    out["adamw_losses"] = tm.train(model, opt, xs, ys, dp, ndp)
    out["adamw"] = tm.full_of(model)
    model = _model(mesh, seed, dp=tm.DP_3D)
    opt = rfsdp.optim.Muon(tm.muon_groups(model), **MUON)
    tm.train(model, opt, xs, ys, dp, ndp)
    out["muon"] = tm.full_of(model)
    model = _model(mesh, seed, dp=tm.DP_3D)
    per = xs.shape[1] // ndp
    torch.nn.functional.mse_loss(model(xs[0][dp * per:(dp + 1) * per]),
                                 ys[0][dp * per:(dp + 1) * per]).backward()
    out["clip_norm"] = float(rfsdp.clip_grad_norm_(model, CLIP))
    return out


@pytest.fixture(scope="module")
def got_3d():
    return run_ranks(worker_3d, 8, SEED)


def _expert_parallel(mesh, seed, policy=None):
    """The MoE block with its expert stacks Shard(0) over mesh["ep"] (torchtitan's
    ExpertParallel), then rfsdp.fully_shard: the experts over mesh["dp"] (each ep
    rank's experts planned over its dp ranks), the rest over the (dp, ep) ranks."""
    from torch.distributed.tensor import Shard, distribute_tensor
    torch.manual_seed(seed)
    model = tm.MoE()
    for name in ("w1", "w2"):
        w = getattr(model.experts, name)
        setattr(model.experts, name,
                torch.nn.Parameter(distribute_tensor(w.data, mesh["ep"], [Shard(0)])))
    rfsdp.fully_shard(model.experts, mesh=mesh["dp"], policy=policy)
    rfsdp.fully_shard(model, mesh=mesh["dp", "ep"]._flatten(), policy=policy)
    return model


def worker_ep(rank, world, seed, folder):
    """Expert parallelism, mesh (dp=2, ep=2): AdamW; Muon with whole experts
    (policy.muon(whole=True): each dp rank one of its ep rank's two experts);
    AdamW saved on the mesh by rfsdp.checkpoint (loaded in one process: ep 1);
    AdamW8bit on fixed gradients."""
    mesh = tm.mesh_ep()
    xs, ys = tm.data(seed, STEPS)
    out = {}
    model = _expert_parallel(mesh, seed)
    opt = rfsdp.optim.AdamW(model.parameters(), **ADAMW)
    out["adamw_losses"] = tm.train(model, opt, xs, ys, rank, world)
    out["adamw"] = tm.full_of(model)
    model = _expert_parallel(mesh, seed, policy=rfsdp.policy.muon(whole=True))
    opt = rfsdp.optim.Muon(tm.muon_groups(model, tm.EXPERT_STACKS), **MUON)
    out["muon_losses"] = tm.train(model, opt, xs, ys, rank, world)
    out["muon"] = tm.full_of(model)
    out["experts_sent"] = opt._impl.gather_send_elems()
    # Muon per block of each expert's rows (policy.muon's split of the stacks: the
    # blocks are each expert's, which ep's Shard(0) of the experts never cuts).
    model = _expert_parallel(mesh, seed, policy=rfsdp.policy.muon(split=EXPERT_BLOCKS))
    opt = rfsdp.optim.Muon(tm.muon_groups(model, tm.EXPERT_STACKS), **MUON)
    tm.train(model, opt, xs, ys, rank, world)
    out["muon_blocks"] = tm.full_of(model)
    model = _expert_parallel(mesh, seed)
    opt = rfsdp.optim.AdamW(model.parameters(), **ADAMW)
    tm.train(model, opt, xs[:2], ys[:2], rank, world)
    rfsdp.checkpoint.save(folder + "/ep", model, opt)
    # AdamW8bit given fixed gradients: blocks of 16 of each expert (48 elements).
    model = _expert_parallel(mesh, seed, policy=rfsdp.policy.blockwise_8bit(16))
    opt = rfsdp.optim.AdamW8bit(model.parameters(), **EP_8BIT)
    _step_with(model, opt, tm.gradients(seed, STEPS, tm.MoE))
    out["8bit"] = tm.full_of(model)
    return out


@pytest.fixture(scope="module")
def got_ep():
    with tempfile.TemporaryDirectory() as d:
        yield run_ranks(worker_ep, 4, SEED, d), d + "/ep"


def _one_process(opt_of, module=tm.Block):
    return tm.one_process(module, opt_of, SEED, STEPS)


def _one_process_fixed(module, cls, kw):
    """{name: parameter} of cls on one process given tm.gradients."""
    model, _ = tm.one_process_fixed(
        module, lambda m: getattr(rfsdp.optim, cls)(m.parameters(), **kw), SEED, STEPS)
    return {n: p.detach() for n, p in model.named_parameters()}


_close = tm.assert_close_all


def test_shards_present_the_global_shape_over_dp_and_tp(got):
    ranks, _ = got
    shapes = {n: tuple(p.shape) for n, p in tm.Block().named_parameters()}
    tp_sharded = {"qkv.weight", "proj.weight", "fc1.weight", "fc1.bias", "fc2.weight"}
    for r in range(4):
        for n, (kind, _, global_shape, group) in ranks[r]["placements"].items():
            assert kind == "Parameter" and tuple(global_shape) == shapes[n], (r, n)
            assert group == (4 if n in tp_sharded else 2), (r, n, group)


def test_adamw_matches_one_process(got):
    ranks, _ = got
    losses, want = _one_process(lambda m: torch.optim.AdamW(m.parameters(), **ADAMW))
    assert ranks[0]["adamw_losses"] == pytest.approx(losses, rel=1e-6)
    for r in range(4):
        _close(ranks[r]["adamw"], want, "AdamW, rank %d" % r)


def test_optimizer_built_before_sharding_follows_the_tp_shards(got):
    ranks, _ = got
    _, want = _one_process(lambda m: torch.optim.AdamW(m.parameters(), **ADAMW))
    for r in range(4):
        _close(ranks[r]["adamw_built_before"], want, "AdamW built before, rank %d" % r)


def test_requires_grad_changed_after_sharding_is_followed_as_one_process(got):
    ranks, _ = got
    xs, ys = tm.data(SEED, STEPS)
    torch.manual_seed(SEED)
    model = tm.Block()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = _train_freezing(model, torch.optim.AdamW(model.parameters(), **ADAMW), xs, ys)
    want = {n: p.detach() for n, p in model.named_parameters()}
    assert ranks[0]["frozen_losses"] == pytest.approx(losses, rel=1e-6)
    for r in range(4):
        _close(ranks[r]["frozen"], want, "frozen after one step, rank %d" % r)
    # (the freeze held: AdamW's decay alone would move a frozen weight that still stepped)
    _, unfrozen = _one_process(lambda m: torch.optim.AdamW(m.parameters(), **ADAMW))
    assert not torch.allclose(want["fc1.weight"], unfrozen["fc1.weight"])
    assert not torch.equal(want["fc1.weight"], before["fc1.weight"])


def test_sharded_state_dict_through_dcp_loads_every_piece(got):
    ranks, _ = got
    for r in range(4):
        _close(ranks[r]["dcp_model"], ranks[r]["adamw_built_before"], "DCP, rank %d" % r, tol=0)


def test_activation_checkpointing_and_kept_gathered_unit_match_one_process(got):
    ranks, _ = got
    _, want = _one_process(lambda m: torch.optim.AdamW(m.parameters(), **ADAMW))
    for r in range(4):
        _close(ranks[r]["checkpointed"], want, "checkpointed, rank %d" % r)


def test_full_state_dict_is_the_global_parameters_and_loads_back(got):
    ranks, _ = got
    for r in range(4):
        sd = ranks[r]["full_state_dict"]
        assert set(sd) == set(ranks[r]["adamw"])
        _close(sd, ranks[r]["adamw"], "full state dict, rank %d" % r, tol=0)
        _close(ranks[r]["loaded_full"], ranks[r]["adamw"], "loaded, rank %d" % r, tol=0)


def test_clip_grad_norm_over_dp_and_tp_matches_one_process(got):
    ranks, _ = got
    xs, ys = tm.data(SEED, STEPS)
    torch.manual_seed(SEED)
    model = tm.Block()
    torch.nn.functional.mse_loss(model(xs[0]), ys[0]).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    want = {n: p.detach() for n, p in model.named_parameters()}
    for r in range(4):
        assert ranks[r]["clip_norm"] == pytest.approx(float(norm), rel=1e-5)
        _close(ranks[r]["clipped_step"], want, "clipped step, rank %d" % r)


def test_bfloat16_compute_equals_torch_fsdp2_on_the_same_model(got):
    ranks, _ = got
    for r in range(4):
        assert ranks[r]["bf16_rfsdp_losses"] == ranks[r]["bf16_fsdp2_losses"]
        _close(ranks[r]["bf16_rfsdp"], ranks[r]["bf16_fsdp2"], "bf16 vs FSDP2, rank %d" % r)


def test_gradient_accumulation_without_sync_equals_the_whole_batch(got):
    ranks, _ = got
    xs, ys = tm.data(SEED, STEPS)
    torch.manual_seed(SEED)
    model = tm.Block()
    torch.nn.functional.mse_loss(model(xs[0]), ys[0]).backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    for r in range(4):
        _close(ranks[r]["accumulated_step"], {n: p.detach() for n, p in model.named_parameters()},
               "accumulated, rank %d" % r)


def test_muon_matches_float64_one_device(got):
    ranks, _ = got
    losses, want = tm.muon_float64(tm.Block, tm.MATRICES, SEED, STEPS, **MUON)
    assert ranks[0]["muon_losses"] == pytest.approx(losses, rel=1e-5)
    for r in range(4):
        _close(ranks[r]["muon"], want, "Muon, rank %d" % r, tol=1e-5)


def test_muon_per_head_sends_nothing_and_matches_float64_one_device(got):
    ranks, _ = got
    losses, want = tm.muon_float64(tm.Block, ["qkv.weight"], SEED, STEPS, splits=HEAD_BLOCKS,
                                   **MUON)
    assert ranks[0]["heads_losses"] == pytest.approx(losses, rel=1e-5)
    for r in range(4):
        assert ranks[r]["heads_sent"] == 0, (r, ranks[r]["heads_sent"])
        _close(ranks[r]["heads"], want, "Muon per head, rank %d" % r, tol=1e-5)


def test_muon_resumed_through_dcp_continues_as_uninterrupted(got):
    ranks, _ = got
    for r in range(4):
        _close(ranks[r]["muon_resumed"], ranks[r]["muon"], "Muon resumed, rank %d" % r, tol=0)


@pytest.mark.parametrize("key,cls,kw", TILED, ids=[k for k, _, _ in TILED])
def test_tiled_optimizers_match_one_process(got, key, cls, kw):
    ranks, _ = got
    want = _one_process_fixed(tm.Block, cls, kw)
    for r in range(4):
        _close(ranks[r][key], want, "%s, rank %d" % (cls, r), tol=1e-5)


def test_checkpoint_from_the_mesh_goes_on_in_one_process(got):
    ranks, path = got
    got_on = tm.resumed_in_one_process(
        tm.Block, lambda m: rfsdp.optim.AdamW(m.parameters(), **ADAMW), path, SEED, STEPS)
    _close(got_on, ranks[0]["adamw"], "resumed in one process")


def test_refusals_name_the_placement_and_the_way(got):
    ranks, _ = got
    for r in range(4):
        cls, msg = ranks[r]["uneven"]
        assert "ValueError" in cls and "Shard(dim=1)" in msg and "divide" in msg, msg
        cls, msg = ranks[r]["no_mesh"]
        assert "ValueError" in cls and "mesh=mesh['dp']" in msg and "qkv.weight" in msg, msg


def test_hsdp_x_tp_adamw_matches_one_process(got_3d):
    losses, want = _one_process(lambda m: torch.optim.AdamW(m.parameters(), **ADAMW))
    assert got_3d[0]["adamw_losses"] == pytest.approx(losses, rel=1e-6)
    for r in range(8):
        _close(got_3d[r]["adamw"], want, "HSDP x TP AdamW, rank %d" % r)


def test_hsdp_x_tp_muon_matches_float64_one_device(got_3d):
    _, want = tm.muon_float64(tm.Block, tm.MATRICES, SEED, STEPS, **MUON)
    for r in range(8):
        _close(got_3d[r]["muon"], want, "HSDP x TP Muon, rank %d" % r, tol=1e-5)


def test_hsdp_x_tp_clip_norm_matches_one_process(got_3d):
    xs, ys = tm.data(SEED, STEPS)
    torch.manual_seed(SEED)
    model = tm.Block()
    torch.nn.functional.mse_loss(model(xs[0]), ys[0]).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    for r in range(8):
        assert got_3d[r]["clip_norm"] == pytest.approx(float(norm), rel=1e-5)


def test_ep_adamw_matches_one_process(got_ep):
    ranks, _ = got_ep
    losses, want = _one_process(lambda m: torch.optim.AdamW(m.parameters(), **ADAMW), tm.MoE)
    assert ranks[0]["adamw_losses"] == pytest.approx(losses, rel=1e-6)
    for r in range(4):
        _close(ranks[r]["adamw"], want, "EP AdamW, rank %d" % r)


def test_ep_muon_whole_experts_send_nothing_and_match_float64_one_device(got_ep):
    ranks, _ = got_ep
    losses, want = tm.muon_float64(tm.MoE, tm.EXPERT_STACKS, SEED, STEPS, **MUON)
    assert ranks[0]["muon_losses"] == pytest.approx(losses, rel=1e-5)
    for r in range(4):
        assert ranks[r]["experts_sent"] == 0, (r, ranks[r]["experts_sent"])
        _close(ranks[r]["muon"], want, "EP Muon, rank %d" % r, tol=1e-5)


def test_ep_muon_per_block_of_each_expert_matches_float64_one_device(got_ep):
    ranks, _ = got_ep
    _, want = tm.muon_float64(tm.MoE, tm.EXPERT_STACKS, SEED, STEPS, splits=EXPERT_BLOCKS,
                              **MUON)
    for r in range(4):
        _close(ranks[r]["muon_blocks"], want, "EP Muon per block, rank %d" % r, tol=1e-5)


def test_ep_adamw8bit_blocks_per_expert_match_one_process(got_ep):
    ranks, _ = got_ep
    want = _one_process_fixed(tm.MoE, "AdamW8bit", EP_8BIT)
    for r in range(4):
        _close(ranks[r]["8bit"], want, "EP AdamW8bit, rank %d" % r)


def test_ep_checkpoint_goes_on_in_one_process(got_ep):
    ranks, path = got_ep
    got_on = tm.resumed_in_one_process(
        tm.MoE, lambda m: rfsdp.optim.AdamW(m.parameters(), **ADAMW), path, SEED, STEPS)
    _close(got_on, ranks[0]["adamw"], "EP resumed in one process")
