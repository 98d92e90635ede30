"""fully_shard on 1 and 2 ranks (processes, Gloo) against the same model trained
unsharded with torch.optim.AdamW on the whole batch; misuse errors."""
import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import rfsdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import CLIP, STEPS, Block, Net, data, reference  # noqa: E402,F401
from slice_training import assert_trains_like, train_on_slices  # noqa: E402
from ranks import run_ranks  # noqa: E402

HANG_SECONDS = 60


def worker(rank, world, seed, reshard):
    torch.manual_seed(seed)
    model = Net()
    for b in model.blocks:
        rfsdp.fully_shard(b, reshard_after_forward=reshard)
    rfsdp.fully_shard(model)
    # Prefetch probes (hooks added after fully_shard's run after its hooks): at the
    # start of block i's forward, is block i+1 gathered (or being gathered)? At the
    # start of block i's backward, is block i-1? And has block i+1, whose backward is
    # done, freed its gathered parameters (its reduce-scatter started)?
    fwd_seen, bwd_seen, bwd_freed = [], [], []
    blocks = list(model.blocks)

    def gathered(i):
        return blocks[i]._rfsdp_unit.unit.unsharded()

    for i, b in enumerate(blocks):
        if i + 1 < len(blocks):
            b.register_forward_pre_hook(lambda m, a, i=i: fwd_seen.append(gathered(i + 1)))
        def probe_backward(m, a, out, i=i):
            def probe(g):
                if i > 0:
                    bwd_seen.append(gathered(i - 1))
                if i + 1 < len(blocks):
                    bwd_freed.append(not gathered(i + 1))
            out.register_hook(probe)
        b.register_forward_hook(probe_backward)
    opt = rfsdp.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    xs, ys = data(seed)

    def idle_and_sharded():
        # Between steps every unit is idle, with only its local slices (the
        # gathered buffers are freed, no collective in flight).
        for u in rfsdp.fsdp.units(model):
            assert u.state is rfsdp.fsdp.TrainingState.IDLE, u.state
            assert u.data_state() is rfsdp.fsdp.DataState.SHARDED, u.data_state()
    losses = train_on_slices(model, opt, xs, ys, rank, world,
                             before_step=lambda: rfsdp.clip_grad_norm_(model, CLIP),
                             after_step=idle_and_sharded)
    # Gather the full parameters by name: shards -> rows of the global tensors.
    params = rfsdp.full_parameters(model)
    return {"losses": losses, "params": params, "fwd": fwd_seen, "bwd": bwd_seen,
            "bwd_freed": bwd_freed}


@pytest.mark.parametrize("world,reshard", [(1, True), (2, True), (2, False)])
def test_matches_unsharded_torch_adamw(world, reshard):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    ref_losses, ref_params = reference(seed)
    got = run_ranks(worker, world, seed, reshard, timeout=HANG_SECONDS)[0]
    assert got["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), "seed %d" % seed
    assert_trains_like(ref_params, got["params"], 1e-5, 1e-5, "seed %d" % seed)
    # Prefetch: from the second step on, the next unit's gather has started before
    # it is needed (with reshard_after_forward=False everything stays gathered).
    per_step = len(got["fwd"]) // STEPS
    assert per_step == Net().blocks.__len__() - 1
    assert got["fwd"][per_step:] == [True] * (len(got["fwd"]) - per_step)
    assert got["bwd"] == [True] * len(got["bwd"]) and len(got["bwd"]) == STEPS * per_step
    if reshard:
        assert got["fwd"][:per_step] == [False] * per_step  # nothing recorded yet
    assert got["bwd_freed"] == [True] * (STEPS * per_step)


def test_misuse_errors(one_rank):
    model = Net()
    old_params = list(model.parameters())
    rfsdp.fully_shard(model)
    with pytest.raises(ValueError, match="already applied"):
        rfsdp.fully_shard(model)
    # (an optimizer over the replaced parameters follows them to their shards:
    # tests/python/test_optimizer_before_sharding.py)
    opt = rfsdp.optim.AdamW(old_params)
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], model.parameters()))
    with pytest.raises(ValueError, match="granule must be a positive integer or \"whole\""):
        rfsdp.fully_shard(Net(), policy=rfsdp.policy.Policy(lambda n, p: 0))
    with pytest.raises(ValueError, match="granule must be a positive integer"):
        rfsdp.fully_shard(Net(), policy=rfsdp.policy.Policy(lambda n, p: "half"))
    two_devices = Net()
    two_devices.head.weight = nn.Parameter(two_devices.head.weight.detach().to("meta"))
    with pytest.raises(ValueError, match="different devices"):
        rfsdp.fully_shard(two_devices)


def test_reduce_goes_straight_into_zeroed_gradients(one_rank):
    """After the optimizer zeroed the gradients, a unit's reduce-scatter writes into
    the local gradient slice: nothing is added from a scratch slice (bytes_cast)
    and the Comm copies the same bytes every step. Accumulating a second backward
    adds exactly one slice per unit."""
    model = Net()
    for b in model.blocks:
        rfsdp.fully_shard(b)
    rfsdp.fully_shard(model)
    opt = rfsdp.optim.AdamW(model.parameters(), lr=1e-2)
    us = rfsdp.fsdp.units(model)
    xs, ys = data(0)

    def counts():
        return (sum(u.unit.bytes_cast() for u in us),
                sum(u.comm.stats()["bytes_copied"] for u in us))

    per_step = []
    for step in range(4):
        before = counts()
        opt.zero_grad()
        nn.functional.mse_loss(model(xs[step]), ys[step]).backward()
        opt.step()
        after = counts()
        assert after[0] == before[0], "step %d added a scratch slice" % step
        per_step.append(after[1] - before[1])
    assert len(set(per_step)) == 1, per_step  # the first step copies no more than the others
    before = counts()
    opt.zero_grad()
    for step in range(2):
        nn.functional.mse_loss(model(xs[step]), ys[step]).backward()
    assert counts()[0] - before[0] == sum(u.plan.S * 4 for u in us)


def test_8bit_optimizer_needs_whole_blocks(one_rank):
    model = nn.Linear(300, 40)
    rfsdp.fully_shard(model, policy=rfsdp.policy.blockwise_8bit(256))
    opt = rfsdp.optim.AdamW8bit(model.parameters(), block=256)
    model(torch.randn(4, 300)).sum().backward()
    opt.step()
    sd = opt.state_dict()  # a sharded parameter's states: their pieces of the global tensors
    assert isinstance(sd["state"][0]["absmax1"], torch.Tensor) and hasattr(sd["state"][0]["q1"], "local")
    opt2 = rfsdp.optim.AdamW8bit(model.parameters(), block=256)
    opt2.load_state_dict(sd)
    p = next(model.parameters())
    assert torch.equal(opt2.state[p]["q1"], opt.state[p]["q1"])
    # A shard that starts inside a block (rows 150.. of a 300 x 40 tensor: element
    # 6000, not a multiple of 256) is refused by name; one on a block edge is not.
    cut = nn.Parameter(torch.zeros(150, 40))
    cut._rfsdp_shard = rfsdp.ShardInfo("w", (300, 40), 1, 150, 300)
    with pytest.raises(ValueError, match="parameter 'w'.*cut its 1-D blocks of 256"):
        rfsdp.optim.AdamW8bit([cut], block=256)
    edge = nn.Parameter(torch.zeros(140, 40))
    edge._rfsdp_shard = rfsdp.ShardInfo("w", (300, 40), 1, 160, 300)  # element 6400 = 25 blocks
    rfsdp.optim.AdamW8bit([edge], block=256)


def mp_worker(rank, world, seed, param_dtype):
    torch.manual_seed(seed)
    model = Net()
    mp_policy = rfsdp.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for b in model.blocks:
        rfsdp.fully_shard(b, mp_policy=mp_policy)
    rfsdp.fully_shard(model, mp_policy=mp_policy)
    xs, ys = data(seed)
    per = xs.shape[1] // world
    outs = []
    for step in range(2):  # two micro-batches: the sharded .grad accumulates
        xb = xs[step, rank * per:(rank + 1) * per]
        out = model(xb)  # a float32 batch meets param_dtype weights: inputs are cast
        outs.append(out.detach().float())
        out.float().square().mean().backward()
    grads = {}
    for name, p in model.named_parameters():
        info = rfsdp.shard_info(p)
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
        rows = torch.zeros(info.full_rows, info.row_len)
        rows[info.row_begin:info.row_end] = p.grad.reshape(-1, info.row_len)
        dist.all_reduce(rows)
        grads[name] = rows.reshape(info.global_shape)
    outs = torch.stack(outs)
    all_outs = [torch.zeros_like(outs) for _ in range(world)]
    dist.all_gather(all_outs, outs)
    return {"outs": torch.cat(all_outs, dim=1), "grads": grads}


@pytest.mark.parametrize("world,param_dtype", [(1, torch.bfloat16), (2, torch.bfloat16),
                                               (2, torch.float16)])
def test_mixed_precision_matches_low_precision_reference(world, param_dtype):
    """Forward and backward in param_dtype on gathered weights, gradients averaged
    over ranks in float32: the reference is the unsharded model cast to
    param_dtype, each rank's micro-batch backward on its own, the float32 mean."""
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    got = run_ranks(mp_worker, world, seed, param_dtype)[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' matmul order, so low-precision results agree
    try:
        torch.manual_seed(seed)
        ref = Net()
        xs, _ = data(seed)
        per = xs.shape[1] // world
        ref_grads = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in ref.named_parameters()}
        low = Net().to(param_dtype)
        low.load_state_dict(ref.state_dict())
        ref_outs = []
        for step in range(2):
            row = []
            for r in range(world):
                low.zero_grad()
                o = low(xs[step, r * per:(r + 1) * per].to(param_dtype))
                row.append(o.detach().float())
                o.float().square().mean().backward()
                for n, p in low.named_parameters():
                    ref_grads[n] += p.grad.double() / world
            ref_outs.append(torch.cat(row))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(got["outs"], torch.stack(ref_outs), rtol=0, atol=0)
    for n, g in ref_grads.items():
        torch.testing.assert_close(got["grads"][n], g.float(), rtol=1e-6, atol=1e-7,
                                   msg=lambda m: "%s (seed %d): %s" % (n, seed, m))


def test_prefetch_can_be_turned_off_and_changes_no_number(one_rank):
    torch.manual_seed(int(torch.randint(0, 2 ** 30, ()).item()))
    base = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    x, y = torch.randn(5, 8), torch.randn(5, 8)
    params, states = {}, {}
    for enabled in (True, False):
        m = copy.deepcopy(base)
        for layer in m:
            rfsdp.fully_shard(layer)
        rfsdp.fully_shard(m)
        rfsdp.set_prefetch(m, enabled)
        seen = states[enabled] = []
        # after layer 0's pre-forward: has layer 1's gather started?
        m[0].register_forward_pre_hook(lambda mod, a: seen.append(m[1]._rfsdp_unit.data_state()))
        opt = rfsdp.optim.AdamW(m.parameters(), lr=1e-2)
        for _ in range(3):
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
        params[enabled] = rfsdp.full_parameters(m)
    # the first forward records the order; prefetch starts from the second
    assert states[True][1:] == [rfsdp.fsdp.DataState.GATHERING] * 2, states[True]
    assert states[False] == [rfsdp.fsdp.DataState.SHARDED] * 3, states[False]
    for n in params[True]:
        assert torch.equal(params[True][n], params[False][n]), n
