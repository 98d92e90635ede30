"""AdamW8bit with state_format="float8_e4m3fn": codes against torch's cast, the step
against a float64 transcription of its definition, 2 ranks whose shards cut blocks
against one process bit for bit, the device-generic path against the kernels, the
sparse-row bound, and checkpoints moved between the dynamic map and float8 codes."""
import os
import sys

import pytest
import torch
from torch import nn

import rfsdp

sys.path.insert(0, os.path.dirname(__file__))
from ranks import run_ranks  # noqa: E402
from test_fsdp2_params import check_cut_8bit, cut_8bit  # noqa: E402
from test_quant_py import (SPARSE_HYPER, BLOCK, block_ids, largest_move_over_lr,  # noqa: E402
                           sparse_row_grads)

FP8 = "float8_e4m3fn"


def e4m3(q):
    """The values of codes q (uint8), float64, as torch reads float8_e4m3fn bits."""
    return q.view(torch.float8_e4m3fn).double()


def test_codes_are_torchs_cast_of_the_block_scaled_values():
    # every block's scale is its absmax / 448: the codes are torch's cast of x * 448 / absmax
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 30, ()).item()))
    x = torch.randn(37, 530, generator=gen) * torch.logspace(-6, 2, 530)
    for block in (256, (32, 32)):
        q, a = rfsdp.quant.quantize_blockwise(x, block, code=FP8)
        ids = block_ids(37, 530, block)
        want_a = torch.zeros(len(a)).scatter_reduce(0, ids, x.reshape(-1).abs(), "amax")
        assert torch.equal(a, want_a)
        y = x.reshape(-1) * (448.0 / a)[ids]  # (float32, as the kernels)
        assert torch.equal(q.reshape(-1), y.to(torch.float8_e4m3fn).view(torch.uint8))
        back = rfsdp.quant.dequantize_blockwise(q, a, block, code=FP8)
        want = (q.reshape(-1).view(torch.float8_e4m3fn).float() * (a / 448.0)[ids]).reshape(37, 530)
        assert torch.equal(back, want)


def test_keep_nonzero_gives_every_positive_value_a_code():
    x = torch.tensor([1.0] + [1e-7, 1e-12, 0.0, 3e-3] * 64)
    q, _ = rfsdp.quant.quantize_blockwise(x, 256, code=FP8, keep_nonzero=True)
    assert (q[1:][x[1:] > 0] > 0).all() and (q[1:][x[1:] == 0] == 0).all()
    q0, _ = rfsdp.quant.quantize_blockwise(x, 256, code=FP8)
    assert (q0[1:][(x[1:] > 0) & (x[1:] < 1e-6)] == 0).all()  # (without: the cast's 0)


def fp8_reference(p, g, q1, a1, q2, a2, ids, lr, b1, b2, eps, wd, step):
    """float64 from the definition: decode (e4m3 value * absmax / 448), torch.optim.AdamW's
    update, each block's new absmax, encode (nearest e4m3 of value * 448 / absmax, ties to
    even; v: never 0 above 0). Returns the parameter, the codes' values with a tolerance
    on the scaled values (fp32's roundings: a value that near a midpoint may take either
    neighbour), and the absmax with theirs."""
    b1, b2 = (torch.tensor(b, dtype=torch.float32).item() for b in (b1, b2))
    p, g = p.double(), g.double()
    m = e4m3(q1) * (a1.double() / 448)[ids]
    v = e4m3(q2) * (a2.double() / 448)[ids]
    mscale = (b1 * m).abs() + ((1 - b1) * g).abs()
    vscale = (b2 * v).abs() + (1 - b2) * g * g
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    p = p * (1 - lr * wd) - (lr / bc1) * m / (v.sqrt() / bc2 ** 0.5 + eps)
    nb = int(ids.max()) + 1
    out = [p]
    for x, scale, keep in ((m, mscale, False), (v, vscale, True)):
        am = torch.zeros(nb, dtype=torch.float64).scatter_reduce(0, ids, x.abs(), "amax")
        r = torch.where(am > 0, 448 / am, torch.zeros_like(am))[ids]
        y = x * r
        code = y.to(torch.float8_e4m3fn).view(torch.uint8)  # (via fp32: ambiguous only at ties)
        if keep:
            code = torch.where((code == 0) & (y > 0), torch.ones_like(code), code)
        tol = 1e-6 * scale * r + 1e-6 * y.abs() + 1e-30
        at = 1e-6 * torch.zeros(nb, dtype=torch.float64).scatter_reduce(0, ids, scale, "amax")
        out += [y, e4m3(code), tol, am, at]
    return out


def check_against_reference(msg, p, q1, a1, q2, a2, want, keep_check=True):
    wp, y1, c1, t1, am1, at1, y2, c2, t2, am2, at2 = want
    torch.testing.assert_close(p.reshape(-1).double(), wp, rtol=1e-6, atol=1e-6,
                               msg=lambda m: msg + ": " + m)
    for q, a, y, c, tol, am, at in ((q1, a1, y1, c1, t1, am1, at1), (q2, a2, y2, c2, t2, am2, at2)):
        err = (a.double() - am).abs()
        assert (err <= 1e-5 * am + at).all(), "%s: absmax off by %g" % (msg, float(err.max()))
        got = e4m3(q.reshape(-1))
        differ = got != c
        near_mid = (y - (got + c) / 2).abs() <= tol
        assert not (differ & ~near_mid).any(), "%s: %d codes differ off the midpoints" % (
            msg, int((differ & ~near_mid).sum()))


@pytest.mark.parametrize("shape,block", [((37, 50), 256), ((300, 21), 2048), ((70, 45), (32, 32)),
                                         ((5, 33), (2, 8))])
def test_fp8_step_matches_float64_transcription(shape, block):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    gen = torch.Generator().manual_seed(seed)
    rows, row_len = shape
    n = rows * row_len
    ids = block_ids(rows, row_len, block)
    p = torch.randn(n, generator=gen)
    m0 = torch.randn(n, generator=gen) * 10.0 ** -torch.randint(0, 6, (n,), generator=gen).float()
    v0 = torch.randn(n, generator=gen).square() * 10.0 ** -torch.randint(0, 12, (n,), generator=gen).float()
    q1, a1 = rfsdp.quant.quantize_blockwise(m0.reshape(rows, row_len), block, code=FP8)
    q2, a2 = rfsdp.quant.quantize_blockwise(v0.reshape(rows, row_len), block, code=FP8,
                                            keep_nonzero=True)
    q1, q2 = q1.reshape(-1), q2.reshape(-1)
    hyper = dict(lr=3e-3, b1=0.9, b2=0.99, eps=1e-8, wd=0.1)
    for step in (1, 7):
        g = torch.randn(n, generator=gen)
        want = fp8_reference(p, g, q1, a1, q2, a2, ids, step=step, **hyper)
        unused = rfsdp.quant.dynamic_map(True)  # (float8 codes take no map)
        rfsdp._C.adamw8bit_step(p, g, q1, a1, q2, a2, block, row_len, unused, unused, hyper["lr"],
                                hyper["b1"], hyper["b2"], hyper["eps"], hyper["wd"], step,
                                state_format=FP8)
        check_against_reference("seed %d step %d" % (seed, step), p, q1, a1, q2, a2, want)


def test_the_optimizer_steps_as_the_transcription_on_sparse_rows():
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    gen = torch.Generator().manual_seed(seed)
    h = SPARSE_HYPER
    p = nn.Parameter(torch.randn(64, 32, generator=gen))
    opt = rfsdp.optim.AdamW8bit([p], lr=h["lr"], betas=(h["b1"], h["b2"]), eps=h["eps"],
                                weight_decay=h["wd"], block=BLOCK, min_8bit_size=1,
                                state_format=FP8)
    assert opt.settings()["state_format"] == FP8
    ids = block_ids(64, 32, BLOCK)
    for step, g in enumerate(sparse_row_grads(gen, 10), 1):
        st = {k: t.clone() for k, t in opt.sharded_state(p).items()}
        want = fp8_reference(p.detach().reshape(-1).clone(), g.reshape(-1), st["q1"],
                             st["absmax1"], st["q2"], st["absmax2"], ids, step=step, **h)
        p.grad = g.clone()
        opt.step()
        now = opt.sharded_state(p)
        check_against_reference("seed %d step %d" % (seed, step), p.detach(), now["q1"],
                                now["absmax1"], now["q2"], now["absmax2"], want)


def test_fp8_on_sparse_rows_moves_no_element_further_than_twice_exact_adamw():
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    grads = sparse_row_grads(torch.Generator().manual_seed(seed), 12)
    h = SPARSE_HYPER
    kw = dict(lr=h["lr"], betas=(h["b1"], h["b2"]), eps=h["eps"], weight_decay=h["wd"])
    exact = largest_move_over_lr(lambda ps: torch.optim.AdamW(ps, **kw), grads)
    fp8 = largest_move_over_lr(lambda ps: rfsdp.optim.AdamW8bit(
        ps, block=BLOCK, min_8bit_size=1, state_format=FP8, **kw), grads)
    assert exact < 1.5, "seed %d: exact AdamW moved %g lr" % (seed, exact)
    assert fp8 <= 2 * exact, "seed %d: fp8 AdamW8bit moved an element %g lr (exact %g)" % (
        seed, fp8, exact)


def stepped(make, seed, generic=False):
    """Four steps of the optimizer make(params) builds, on two matrices and seeded
    gradients, through the device-generic path or the kernels: (params, opt)."""
    g = torch.Generator().manual_seed(seed)
    ps = [nn.Parameter(torch.randn(s, generator=g)) for s in [(64, 40), (33, 96)]]
    opt = make(ps)
    rfsdp.quant.use_device_generic_path(generic)
    try:
        for _ in range(4):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
    finally:
        rfsdp.quant.use_device_generic_path(False)
    return ps, opt


def run_steps(seed, generic=False):
    ps, opt = stepped(lambda ps: rfsdp.optim.AdamW8bit(ps, lr=1e-2, min_8bit_size=256,
                                                         state_format=FP8), seed, generic)
    return [p.detach().clone() for p in ps] + [
        t.clone() for p in ps for t in opt.state[p].values() if torch.is_tensor(t)]


def test_device_generic_path_equals_the_cpu_kernels_bit_for_bit():
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    kernels, generic = run_steps(seed), run_steps(seed, generic=True)
    assert len(kernels) == len(generic) > 2
    for a, b in zip(kernels, generic):
        assert a.dtype == b.dtype and torch.equal(a, b), seed


# --- 2 ranks whose FSDP2 chunks cut blocks: one process's codes, bit for bit ---------------

def cut_worker(rank, world, seed):
    from torch.distributed.device_mesh import init_device_mesh
    return cut_8bit(init_device_mesh("cpu", (world,)), seed, FP8)


def test_two_ranks_cutting_blocks_equal_one_process_bit_for_bit():
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    check_cut_8bit(run_ranks(cut_worker, 2, seed)[0], seed, FP8)


# --- checkpoints: a dynamic-map checkpoint resumed with float8 codes, and back --------------

def train(opt, ps, seed, steps):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.parametrize("saved_fmt,load_fmt", [(None, FP8), (FP8, None)])
def test_checkpoint_moves_between_formats(saved_fmt, load_fmt, tmp_path):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    model = nn.Linear(64, 48)
    opt = rfsdp.optim.AdamW8bit(model.parameters(), lr=1e-2, min_8bit_size=256,
                                state_format=saved_fmt)
    train(opt, list(model.parameters()), seed, 3)
    path = str(tmp_path / "ckpt")
    rfsdp.checkpoint.save(path, model, opt)
    saved = {k: t.clone() for k, t in opt.sharded_state(model.weight).items()}
    save_code = saved_fmt or "dynamic"

    model2 = nn.Linear(64, 48)
    opt2 = rfsdp.optim.AdamW8bit(model2.parameters(), lr=1e-2, min_8bit_size=256,
                                 state_format=load_fmt)
    with pytest.raises(rfsdp.checkpoint.CheckpointError, match="requantize=True"):
        rfsdp.checkpoint.load(path, model2, opt2)
    # torch's state_dict carries the settings too: a load into the other format is refused
    # (as for another block) and names the requantising load
    with pytest.raises(ValueError, match="state_format.*requantize=True|requantize=True"):
        opt2.load_state_dict(opt.state_dict())
    rfsdp.checkpoint.load(path, model2, opt2, requantize=True)
    got = opt2.sharded_state(model2.weight)
    load_code = load_fmt or "dynamic"
    for codes, scales, signed in (("q1", "absmax1", True), ("q2", "absmax2", False)):
        # the saved moment decoded as it was kept, then encoded as this optimizer keeps it
        x = rfsdp.quant.dequantize_blockwise(saved[codes], saved[scales], 256, code=save_code,
                                             signed=signed, shape=(48, 64))
        q, a = rfsdp.quant.quantize_blockwise(x, 256, code=load_code, signed=signed,
                                              keep_nonzero=not signed)
        assert torch.equal(got[codes].reshape(-1), q.reshape(-1)), (codes, seed)
        assert torch.equal(got[scales], a), (scales, seed)
    assert opt2.settings().get("state_format") == load_fmt
    train(opt2, list(model2.parameters()), seed + 1, 2)  # (and it steps on)
    assert all(torch.isfinite(p).all() for p in model2.parameters())


@pytest.mark.parametrize("saved_fmt,load_fmt", [(None, FP8), (FP8, None)])
def test_soap_checkpoint_moves_its_8bit_moments_between_formats(saved_fmt, load_fmt, tmp_path):
    # one tile (max_preconditioner_dim above both sides): a block per row of the weight
    seed = int(torch.randint(0, 2 ** 30, ()).item())

    def soap(model, fmt):
        return rfsdp.optim.SOAP(model.parameters(), lr=1e-2, state_dtype="int8",
                                max_preconditioner_dim=64, precondition_frequency=2,
                                state_format=fmt)
    model = nn.Linear(40, 24)
    opt = soap(model, saved_fmt)
    train(opt, list(model.parameters()), seed, 4)
    path = str(tmp_path / "ckpt")
    rfsdp.checkpoint.save(path, model, opt)
    saved = {k: t.clone() for k, t in opt.sharded_state(model.weight).items()}
    model2 = nn.Linear(40, 24)
    opt2 = soap(model2, load_fmt)
    with pytest.raises(rfsdp.checkpoint.CheckpointError, match="requantize=True"):
        rfsdp.checkpoint.load(path, model2, opt2)
    rfsdp.checkpoint.load(path, model2, opt2, requantize=True)
    got = opt2.sharded_state(model2.weight)
    for m, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        x = rfsdp.quant.dequantize_blockwise(saved[m + "_codes"], saved[m + "_absmax"], 40,
                                             code=saved_fmt or "dynamic", signed=signed,
                                             shape=(24, 40))
        assert x.abs().max() > 0, m
        q, a = rfsdp.quant.quantize_blockwise(x, 40, code=load_fmt or "dynamic", signed=signed,
                                              keep_nonzero=not signed)
        assert torch.equal(got[m + "_codes"].reshape(-1), q.reshape(-1)), (m, seed)
        assert torch.equal(got[m + "_absmax"], a), (m, seed)
    assert opt2.settings().get("state_format") == load_fmt
    train(opt2, list(model2.parameters()), seed + 1, 2)  # (and it steps on)
    assert all(torch.isfinite(p).all() for p in model2.parameters())


def test_soap_state_format_without_8bit_moments_is_refused():
    with pytest.raises(ValueError, match="state_dtype=\"int8\""):
        rfsdp.optim.SOAP([nn.Parameter(torch.zeros(8, 8))], state_format=FP8)


def test_bad_state_format_is_refused():
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        rfsdp.optim.AdamW8bit([nn.Parameter(torch.zeros(8))], state_format="fp8")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        rfsdp.optim.AdamW8bit([nn.Parameter(torch.zeros(8))], state_format=8)


# --- Muon's 8-bit momentum in float8_e4m3fn codes -------------------------------------------

def muon_steps(seed, generic):
    return stepped(lambda ps: rfsdp.optim.Muon(ps, lr=0.02, momentum_dtype="int8",
                                               momentum_block=64, momentum_map=FP8),
                   seed, generic)


def test_muon_fp8_momentum_is_the_cast_of_the_fp32_momentum_and_generic_equals_kernels():
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    ps, opt = muon_steps(seed, False)
    gps, gopt = muon_steps(seed, True)
    for p, gp in zip(ps, gps):
        assert torch.equal(p, gp), seed
        for k, t in opt.state[p].items():
            if torch.is_tensor(t):
                assert torch.equal(t, gopt.state[gp][k]), (k, seed)
    # one step from a zero momentum: m = lerp(0, g, 1 - beta), coded as the cast of m * 448 / absmax
    g = torch.Generator().manual_seed(seed)
    p = nn.Parameter(torch.randn(64, 40, generator=g))
    opt = rfsdp.optim.Muon([p], lr=0.02, momentum=0.95, momentum_dtype="int8", momentum_block=64,
                           momentum_map=FP8)
    p.grad = torch.randn(64, 40, generator=g)
    opt.step()
    st = opt.sharded_state(p)
    m = torch.lerp(torch.zeros(64 * 40), p.grad.reshape(-1), torch.tensor(1.0, dtype=torch.float32)
                   - torch.tensor(0.95, dtype=torch.float32))
    q, a = rfsdp.quant.quantize_blockwise(m, 64, code=FP8)
    assert torch.equal(st["momentum_absmax"].reshape(-1), a), seed
    assert torch.equal(st["momentum_codes"].reshape(-1), q), seed


def test_muon_checkpoint_moves_from_the_dynamic_map_to_float8_codes(tmp_path):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    model = nn.Linear(64, 48, bias=False)
    opt = rfsdp.optim.Muon(model.parameters(), lr=0.02, momentum_dtype="int8", momentum_block=64)
    train(opt, list(model.parameters()), seed, 2)
    path = str(tmp_path / "ckpt")
    rfsdp.checkpoint.save(path, model, opt)
    saved = {k: t.clone() for k, t in opt.sharded_state(model.weight).items()}
    model2 = nn.Linear(64, 48, bias=False)
    opt2 = rfsdp.optim.Muon(model2.parameters(), lr=0.02, momentum_dtype="int8",
                            momentum_block=64, momentum_map=FP8)
    rfsdp.checkpoint.load(path, model2, opt2, requantize=True)
    got = opt2.sharded_state(model2.weight)
    x = rfsdp.quant.dequantize_blockwise(saved["momentum_codes"].reshape(-1),
                                         saved["momentum_absmax"].reshape(-1), 64)
    q, a = rfsdp.quant.quantize_blockwise(x, 64, code=FP8)
    assert torch.equal(got["momentum_codes"].reshape(-1), q), seed
    assert torch.equal(got["momentum_absmax"].reshape(-1), a), seed
    train(opt2, list(model2.parameters()), seed + 1, 1)
