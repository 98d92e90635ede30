"""Quantised collectives (rfsdp.CommPolicy on fully_shard), on 1-3 ranks, against
independent references:
- weights "int8" / "float8_e4m3fn": the weights a unit computes with equal a
  per-block quantise/dequantise of the *global* tensor (blocks from the tensor's
  start; its rounding checked in float64), bit for bit on every world size; a
  quantiser that blocks each rank's slice instead gives other weights (so the
  comparison can tell); loss and gradients equal a single-process model whose
  weights are those values;
- gradients bfloat16: the reduced gradient equals the fp32 mean of the per-rank
  gradients each rounded to bf16, bit for bit, and is closer to the fp32 mean than
  a bf16-summed reduce-scatter (mp_policy reduce_dtype=bfloat16);
- HSDP (2 x 2) alike; a checkpoint saved under one policy loads under another."""
import copy
import os
import sys

import pytest
import torch
from torch import nn

import rfsdp
from rfsdp.fsdp.api import units

sys.path.insert(0, os.path.dirname(__file__))
from ranks import run_ranks  # noqa: E402
from slice_training import assert_trains_like  # noqa: E402

BLOCK = 64
CODE_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


def net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(48, 40), nn.ReLU(), nn.Linear(40, 24))


def batch(seed, rank):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(5, 48, generator=g)


def dequantised(w, fmt, block=BLOCK):
    """The reference: w's global blocks of `block` elements from its start, one
    fp32 scale absmax / code_max each, codes as the format rounds them, then
    code * scale in fp32; every element's rounding checked in float64."""
    flat = w.detach().reshape(-1).float()
    n = flat.numel()
    padded = torch.zeros((n + block - 1) // block * block)
    padded[:n] = flat  # (zeros change no block's absmax)
    x = padded.view(-1, block)
    scale = x.abs().amax(dim=1) / CODE_MAX[fmt]
    q = x / torch.where(scale == 0, torch.ones_like(scale), scale)[:, None]
    codes = torch.round(q).clamp(-127, 127) if fmt == "int8" \
        else q.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    out = (codes * scale[:, None]).reshape(-1)[:n]
    # float64: int8 codes are within half a step of w / scale; e4m3 codes within
    # half an ulp of it (3 mantissa bits: 1/16 relative), or 2^-10 below 2^-6.
    err = (out.double() - flat.double()).abs().view(-1)
    s = scale.double().repeat_interleave(block)[:n]
    bound = s * 0.5 if fmt == "int8" else torch.maximum(flat.double().abs() / 16, s * 2.0 ** -10)
    # (+ 1e-4 of a scale: w / scale is rounded in fp32 before its code, up to 448 * 2^-24 off)
    assert bool((err <= bound + s * 1e-4 + 1e-30).all()), "the reference quantiser is wrong"
    return out.view(w.shape)


def slice_blocked(model_full, world, fmt):
    """A quantiser that blocks each rank's slice of the flat buffer (what the test
    must tell apart): the tensors laid out as fully_shard plans them, each rank's
    S elements cut in blocks from the slice's start."""
    plan = units(model_full)[0].plan
    flat = torch.zeros(plan.world_size * plan.S)
    names = [n for n, _ in model_full.named_parameters()]
    full = rfsdp.full_parameters(model_full)
    for i in range(len(names)):
        flat[plan.global_offset(i):plan.global_offset(i) + full[names[i]].numel()] = \
            full[names[i]].reshape(-1)
    pieces = [dequantised(s, fmt) for s in flat.split(plan.S)]
    deq = torch.cat(pieces)
    return {names[i]: deq[plan.global_offset(i):plan.global_offset(i) + full[names[i]].numel()]
            .view(full[names[i]].shape) for i in range(len(names))}


def gathered(model):
    """The weights the unit computes with: its full parameters once gathered."""
    u = units(model)[0]
    u.unit.unshard().wait()
    out = {name: u.unit.full_param(i).clone() for i, name in enumerate(u.plan.names)}
    u.unit.reshard()
    return out


def local_grads(model):
    return {n: (p.grad.clone(), rfsdp.shard_info(p).row_begin) for n, p in model.named_parameters()}


def worker(rank, world, seed):
    base = net(seed)
    out = {}
    for fmt in ("int8", "float8_e4m3fn"):
        m = copy.deepcopy(base)
        rfsdp.fully_shard(m, comm_policy=rfsdp.CommPolicy(weights=fmt, weight_block=BLOCK))
        w = gathered(m)
        loss = m(batch(seed, rank)).square().mean()
        loss.backward()
        out[fmt] = dict(weights=w, loss=loss.item(), grads=local_grads(m),
                        slice_blocked=slice_blocked(m, world, fmt) if world > 1 else None,
                        sent=units(m)[0].unit.gather_bytes_sent())
    # gradients: every rank's full gradients set by hand, reduced by each policy
    g = torch.Generator().manual_seed(seed + 7 + rank)
    grads = [torch.randn(p.shape, generator=g) * 10 ** torch.randint(-2, 3, (), generator=g).item()
             for p in base.parameters()]
    for case, kw in (("bf16", dict(comm_policy=rfsdp.CommPolicy(gradients=torch.bfloat16))),
                     ("bf16_summed", dict(mp_policy=rfsdp.MixedPrecisionPolicy(
                         reduce_dtype=torch.bfloat16))),
                     ("fp32", {})):
        m = copy.deepcopy(base)
        rfsdp.fully_shard(m, **kw)
        u = units(m)[0].unit
        u.prepare_grads()
        for i, gr in enumerate(grads):
            u.full_grad(i).copy_(gr)
        u.reduce_grads().wait()
        out[case] = {n: (u.local_grad(i).clone(), rfsdp.shard_info(p).row_begin)
                     for i, (n, p) in enumerate(m.named_parameters())}
    out["rank_grads"] = grads
    return out


def assemble(per_rank, name):
    rows = sorted((r[name] for r in per_rank), key=lambda t: t[1])
    return torch.cat([t for t, _ in rows])


@pytest.fixture(scope="module")
def runs():
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    return seed, {world: run_ranks(worker, world, seed) for world in (1, 2, 3)}


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
def test_gathered_weights_are_the_global_blocks_quantised_on_every_world_size(runs, fmt):
    seed, got = runs
    model = net(seed)
    want = {n: dequantised(p, fmt) for n, p in model.named_parameters()}
    for world, results in got.items():
        for rank, r in enumerate(results):
            for n, w in want.items():
                assert torch.equal(r[fmt]["weights"][n], w), (fmt, world, rank, n, seed)
            if world > 1:  # a per-slice quantiser differs somewhere: the test can tell
                assert any(not torch.equal(r[fmt]["slice_blocked"][n], w) for n, w in want.items())
    # bytes: codes (1 byte an element) and one fp32 scale a block, of this rank's slice
    # (2 ranks: the other's half; 4 + 4/64 bytes an element would be 1.02 of fp32's)
    assert got[2][0][fmt]["sent"] < 0.3 * 4 * sum(p.numel() for p in model.parameters()) / 2 + 64
    assert got[1][0][fmt]["sent"] == 0


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
def test_loss_and_gradients_are_a_single_process_models_with_those_weights(runs, fmt):
    seed, got = runs
    for world, results in got.items():
        grads = []
        for rank in range(world):
            ref = net(seed)
            with torch.no_grad():
                for n, p in ref.named_parameters():
                    p.copy_(dequantised(p, fmt))
            loss = ref(batch(seed, rank)).square().mean()
            loss.backward()
            torch.testing.assert_close(results[rank][fmt]["loss"], loss.item(), rtol=1e-6, atol=0)
            grads.append({n: p.grad for n, p in ref.named_parameters()})
        for n in grads[0]:
            want = sum(g[n] for g in grads) / world
            got_n = assemble([r[fmt]["grads"] for r in results], n)
            torch.testing.assert_close(got_n, want, rtol=1e-5, atol=1e-7,
                                       msg=lambda m: "%s world %d %s: %s" % (fmt, world, n, m))


def test_bf16_gradients_are_summed_in_fp32_and_beat_a_bf16_sum(runs):
    seed, got = runs
    worse = better = 0.0
    for world, results in got.items():
        names = list(results[0]["bf16"])
        for i, n in enumerate(names):
            per_rank = [r["rank_grads"][i] for r in results]
            acc = per_rank[0].bfloat16().float()
            for g in per_rank[1:]:
                acc = acc + g.bfloat16().float()  # in rank order, in fp32
            want = acc / world
            got_n = assemble([r["bf16"] for r in results], n)
            assert torch.equal(got_n.view(want.shape), want), (world, n, seed)
            exact = sum(g.double() for g in per_rank) / world
            bf16_summed = assemble([r["bf16_summed"] for r in results], n).view(want.shape)
            fp32 = assemble([r["fp32"] for r in results], n).view(want.shape)
            torch.testing.assert_close(fp32.double(), exact, rtol=1e-5, atol=1e-6)
            better += (got_n.view(want.shape).double() - exact).abs().sum().item()
            worse += (bf16_summed.double() - exact).abs().sum().item()
    assert better < 0.8 * worse, (better, worse)


def worker_hsdp(rank, world, seed):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2))
    m = net(seed)
    g = torch.Generator().manual_seed(seed + 7 + rank)
    grads = [torch.randn(p.shape, generator=g) for p in m.parameters()]
    rfsdp.fully_shard(m, mesh=mesh, comm_policy=rfsdp.CommPolicy(weights="int8", weight_block=BLOCK,
                                                                 gradients=torch.bfloat16))
    w = gathered(m)
    u = units(m)[0].unit
    u.prepare_grads()
    for i, gr in enumerate(grads):
        u.full_grad(i).copy_(gr)
    u.reduce_grads().wait()
    return dict(weights=w, grads=grads, shard_rank=mesh.get_local_rank(1),
                reduced={n: (u.local_grad(i).clone(), rfsdp.shard_info(p).row_begin)
                         for i, (n, p) in enumerate(m.named_parameters())})


def test_hsdp_gathers_the_same_codes_and_sums_replicas_in_fp32():
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    got = run_ranks(worker_hsdp, 4, seed)
    model = net(seed)
    for r in got:
        for n, p in model.named_parameters():
            assert torch.equal(r["weights"][n], dequantised(p, "int8")), (n, seed)
    # mesh (2, 2): ranks 0,1 are replica 0's shards 0,1; ranks 2,3 replica 1's.
    # Shard group sums (rank order, fp32, each bf16), then the replicas' sums
    # rounded to bf16 and added in replica order, then / 4.
    names = list(got[0]["reduced"])
    for i, n in enumerate(names):
        def group_sum(ranks):
            acc = got[ranks[0]]["grads"][i].bfloat16().float()
            for k in ranks[1:]:
                acc = acc + got[k]["grads"][i].bfloat16().float()
            return acc
        s0, s1 = group_sum([0, 1]), group_sum([2, 3])
        want = (s0.bfloat16().float() + s1.bfloat16().float()) / 4
        for replica in ((0, 1), (2, 3)):
            have = assemble([got[k]["reduced"] for k in replica], n)
            assert torch.equal(have.view(want.shape), want), (n, replica, seed)


def test_bad_policies_are_clear_errors():
    with pytest.raises(ValueError, match="weights='int4'.*'int8' or 'float8_e4m3fn'"):
        rfsdp.CommPolicy(weights="int4")
    with pytest.raises(ValueError, match="weight_block=0"):
        rfsdp.CommPolicy(weights="int8", weight_block=0)
    with pytest.raises(ValueError, match="gradients.*torch.bfloat16"):
        rfsdp.CommPolicy(gradients=torch.float16)
    with pytest.raises(ValueError, match="comm_policy must be an rfsdp.CommPolicy"):
        rfsdp.fully_shard(net(0), comm_policy="int8")


def worker_checkpoint(rank, world, path, save_fmt, load_fmt):
    """Trained and saved under weights=save_fmt, loaded into another model under
    weights=load_fmt (and bf16 gradients): the parameters (whole) and this rank's
    optimizer state of each, and the target's parameters before the load."""
    def opt_state(opt):  # this rank's state tensors, by parameter index and name
        ps = [p for g in opt.param_groups for p in g["params"]]
        return {"%d.%s" % (k, n): t.clone() for k, p in enumerate(ps)
                for n, t in opt.state[p].items()}
    m = net(3)
    rfsdp.fully_shard(m, comm_policy=rfsdp.CommPolicy(weights=save_fmt) if save_fmt else None)
    opt = rfsdp.optim.AdamW(m.parameters(), lr=1e-2)
    m(batch(3, rank)).sum().backward()
    opt.step()
    rfsdp.checkpoint.save(path, m, opt)
    m2 = net(4)
    rfsdp.fully_shard(m2, comm_policy=rfsdp.CommPolicy(weights=load_fmt, gradients=torch.bfloat16))
    opt2 = rfsdp.optim.AdamW(m2.parameters(), lr=1e-2)
    target = rfsdp.full_parameters(m2)
    rfsdp.checkpoint.load(path, m2, opt2)
    return {"saved": rfsdp.full_parameters(m), "loaded": rfsdp.full_parameters(m2),
            "target": target, "saved_state": opt_state(opt), "loaded_state": opt_state(opt2)}


@pytest.fixture(scope="module")
def policy_checkpoint(tmp_path_factory):
    """Saved under int8 weights, loaded under float8_e4m3fn weights: every rank's."""
    path = str(tmp_path_factory.mktemp("comm_policy") / "ck")
    return run_ranks(worker_checkpoint, 2, path, "int8", "float8_e4m3fn")


def test_a_checkpoint_loads_its_parameters_under_any_comm_policy(policy_checkpoint):
    for rank, r in enumerate(policy_checkpoint):
        assert_trains_like(r["saved"], r["loaded"], what="rank %d" % rank)


def test_a_checkpoint_loads_its_optimizer_state_under_any_comm_policy(policy_checkpoint):
    for rank, r in enumerate(policy_checkpoint):
        assert r["saved_state"], "no optimizer state saved"
        assert_trains_like(r["saved_state"], r["loaded_state"], what="rank %d" % rank)


def test_the_checkpoint_loaded_into_a_model_of_other_values(policy_checkpoint):
    """(So the comparisons above can fail.)"""
    r = policy_checkpoint[0]
    assert all(not torch.equal(r["target"][n], r["saved"][n]) for n in r["saved"])
