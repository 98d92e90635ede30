"""rfsdp.quant from Python: the dynamic map against bitsandbytes' definition
(transcribed here in Python, as bitsandbytes writes it), quantise/dequantise
against a straightforward argmin reference."""
import pytest
import torch

import rfsdp


def create_dynamic_map_reference(signed=True, max_exponent_bits=7, total_bits=8):
    data = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed
                             else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    assert additional_items == 0
    data.append(0)
    data.append(1.0)
    assert len(data) == 2 ** total_bits
    data.sort()
    return torch.tensor(data)


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_equals_bitsandbytes_definition(signed):
    got = rfsdp.quant.dynamic_map(signed=signed)
    want = create_dynamic_map_reference(signed)
    assert got.dtype == torch.float32 and got.shape == (256,)
    assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("block", [256, 2048, (32, 32), (3, 5)])
@pytest.mark.parametrize("signed", [True, False])
def test_quantize_is_nearest_code_of_block_scaled_values(block, signed):
    x = torch.randn(67, 45)
    if not signed:
        x = x.abs()
    code = rfsdp.quant.dynamic_map(signed)
    codes, absmax = rfsdp.quant.quantize_blockwise(x, block=block, signed=signed)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    # Reference: block ids per element, absmax per block, argmin over the code.
    if isinstance(block, int):
        ids = torch.arange(x.numel()).reshape(x.shape) // block
    else:
        r = torch.arange(x.shape[0])[:, None] // block[0]
        c = torch.arange(x.shape[1])[None, :] // block[1]
        ids = r * ((x.shape[1] + block[1] - 1) // block[1]) + c
    n_blocks = int(ids.max()) + 1
    flat_ids, flat_abs = ids.reshape(-1), x.abs().reshape(-1)
    ref_absmax = torch.stack([flat_abs[flat_ids == b].max() for b in range(n_blocks)])
    assert torch.equal(absmax, ref_absmax)
    v = (x.double() / ref_absmax[ids].double())
    dist = (v.reshape(-1, 1) - code.double()[None, :]).abs()
    chosen = dist.gather(1, codes.reshape(-1, 1).long()).squeeze(1)
    assert torch.all(chosen <= dist.min(1).values + 1e-7)
    back = rfsdp.quant.dequantize_blockwise(codes, absmax, block=block, signed=signed)
    assert torch.equal(back, code[codes.long()] * ref_absmax[ids])
    # into a given output: the same values, in that tensor
    out = torch.full((x.numel(),), float("nan"))
    got = rfsdp.quant.dequantize_blockwise(codes, absmax, block=block, signed=signed, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out.view(x.shape), back)


def test_bad_input():
    with pytest.raises(ValueError, match="NaN or Inf"):
        rfsdp.quant.quantize_blockwise(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="float32"):
        rfsdp.quant.quantize_blockwise(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown code map"):
        rfsdp.quant.quantize_blockwise(torch.zeros(4), code="cubic")
    codes, absmax = rfsdp.quant.quantize_blockwise(torch.randn(300))
    with pytest.raises(ValueError, match="out must be contiguous with 300 elements, got 299"):
        rfsdp.quant.dequantize_blockwise(codes, absmax, out=torch.empty(299))
    with pytest.raises(ValueError, match="out must be float32"):
        rfsdp.quant.dequantize_blockwise(codes, absmax, out=torch.empty(300, dtype=torch.float64))


def test_shard_cutting_a_block_is_refused_by_name():
    from rfsdp import _C
    _C.check_whole_blocks(256, "w", 300, 40, 32, 64)  # rows [32, 96): 1280-element edges
    with pytest.raises(ValueError, match="'w'.*32 rows"):
        _C.check_whole_blocks(256, "w", 300, 40, 5, 10)
    with pytest.raises(ValueError, match="'t'"):
        _C.check_whole_blocks((32, 32), "t", 96, 96, 0, 40)  # ends mid-tile


# --- AdamW8bit's step, element by element, against a float64 transcription ------

def block_ids(rows, row_len, block):
    """The block of every element of a rows x row_len tensor (1-D blocks of the
    flattened tensor, or tiles numbered row-major over the tile grid)."""
    if isinstance(block, int):
        return torch.arange(rows * row_len) // block
    tr, tc = block
    r = torch.arange(rows).unsqueeze(1) // tr
    c = torch.arange(row_len).unsqueeze(0) // tc
    return (r * ((row_len + tc - 1) // tc) + c).reshape(-1)


def nearest_code64(x, tol, code, keep_nonzero=False):
    """Index of the nearest code to each x (ties to the lower code), and whether x
    lies within tol (fp32's rounding of x) of the midpoint between two codes.
    keep_nonzero (an unsigned code, v's): x > 0 never takes the code 0."""
    code = code.double()
    idx = torch.searchsorted(code, x).clamp(1, len(code) - 1)
    lo, hi = code[idx - 1], code[idx]
    pick_hi = (hi - x) < (x - lo)
    mid = (lo + hi) / 2
    ambiguous = (x - mid).abs() <= tol
    out = torch.where(pick_hi, idx, idx - 1)
    if keep_nonzero:
        out = torch.where((x > 0) & (out == 0), torch.ones_like(out), out)
        ambiguous = ambiguous & ~((x > 0) & (idx == 1))
    return out, ambiguous


def adamw8bit_reference(p, g, q1, a1, q2, a2, ids, code1, code2, lr, b1, b2, eps, wd, step,
                        keep_nonzero=True):
    """float64: dequantise with the maps, torch.optim.AdamW's update, requantise
    each block by its absmax and the nearest code (v: never the code 0 when above
    0, unless keep_nonzero is off)."""
    # the kernels' betas are float32 (1 - 0.999f is 1.3e-5 away from 0.001): theirs
    b1, b2 = (torch.tensor(b, dtype=torch.float32).item() for b in (b1, b2))
    p, g = p.double(), g.double()
    m = code1.double()[q1.long()] * a1.double()[ids]
    v = code2.double()[q2.long()] * a2.double()[ids]
    mscale = (b1 * m).abs() + ((1 - b1) * g).abs()  # what fp32 rounds (cancellation)
    vscale = (b2 * v).abs() + (1 - b2) * g * g
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    p = p * (1 - lr * wd) - (lr / bc1) * m / (v.sqrt() / bc2 ** 0.5 + eps)
    n_blocks = int(ids.max()) + 1
    am1 = torch.zeros(n_blocks, dtype=torch.float64).scatter_reduce(0, ids, m.abs(), "amax")
    am2 = torch.zeros(n_blocks, dtype=torch.float64).scatter_reduce(0, ids, v.abs(), "amax")
    x1 = torch.where(am1[ids] > 0, m / am1[ids], torch.zeros_like(m))
    x2 = torch.where(am2[ids] > 0, v / am2[ids], torch.zeros_like(v))
    tol1 = torch.where(am1[ids] > 0, 1e-6 * mscale / am1[ids], torch.zeros_like(m)) + 1e-6 * x1.abs()
    tol2 = torch.where(am2[ids] > 0, 1e-6 * vscale / am2[ids], torch.zeros_like(v)) + 1e-6 * x2.abs()
    c1, amb1 = nearest_code64(x1, tol1 + 1e-12, code1)
    c2, amb2 = nearest_code64(x2, tol2 + 1e-12, code2, keep_nonzero=keep_nonzero)
    # fp32's error in a block's absmax: a few roundings of the largest terms it
    # summed, not of the (possibly cancelled) result
    at1 = 1e-6 * torch.zeros(n_blocks, dtype=torch.float64).scatter_reduce(0, ids, mscale, "amax")
    at2 = 1e-6 * torch.zeros(n_blocks, dtype=torch.float64).scatter_reduce(0, ids, vscale, "amax")
    return p, c1, amb1, (am1, at1), c2, amb2, (am2, at2)


@pytest.mark.parametrize("shape,block", [((37, 50), 256), ((300, 21), 2048), ((70, 45), (32, 32)),
                                         ((5, 33), (2, 8))])
def test_adamw8bit_step_matches_float64_transcription(shape, block):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    gen = torch.Generator().manual_seed(seed)
    rows, row_len = shape
    n = rows * row_len
    ids = block_ids(rows, row_len, block)
    n_blocks = rfsdp._C.num_blocks(block, rows, row_len)
    assert n_blocks == int(ids.max()) + 1
    code1, code2 = rfsdp.quant.dynamic_map(True), rfsdp.quant.dynamic_map(False)
    p = torch.randn(n, generator=gen)
    q1 = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    q2 = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    a1 = torch.rand(n_blocks, generator=gen) * 0.1
    a2 = torch.rand(n_blocks, generator=gen) * 0.01
    hyper = dict(lr=3e-3, b1=0.9, b2=0.99, eps=1e-8, wd=0.1)
    for step in (1, 7):
        g = torch.randn(n, generator=gen)
        want = adamw8bit_reference(p, g, q1, a1, q2, a2, ids, code1, code2, step=step, **hyper)
        rfsdp._C.adamw8bit_step(p, g, q1, a1, q2, a2, block, row_len, code1, code2,
                                hyper["lr"], hyper["b1"], hyper["b2"], hyper["eps"], hyper["wd"],
                                step)
        wp, c1, amb1, am1, c2, amb2, am2 = want
        msg = "seed %d step %d" % (seed, step)
        # fp32 against float64: a few roundings, amplified where b1 m and (1 - b1) g cancel
        torch.testing.assert_close(p.double(), wp, rtol=1e-6, atol=1e-6,
                                   msg=lambda m: msg + ": " + m)
        for a, (am, at) in ((a1, am1), (a2, am2)):
            err = (a.double() - am).abs()
            assert (err <= 1e-5 * am + at).all(), "%s: absmax off by %g (block %d)" % (
                msg, float(err.max()), int((err - 1e-5 * am - at).argmax()))
        for q, c, amb in ((q1, c1, amb1), (q2, c2, amb2)):
            differ = q.long() != c
            # fp32 and float64 may round a value lying on a midpoint to either neighbour
            assert not (differ & ~amb).any(), "%s: %d codes differ off the midpoints" % (
                msg, int((differ & ~amb).sum()))
            assert ((q.long() - c).abs() <= 1).all(), msg


# --- AdamW8bit on sparse rows: bounded steps ------------------------------------------------
# An embedding whose rare rows get a small gradient once, inside blocks whose scale busy
# rows set, then none for steps: exact AdamW moves each element about lr a step at most.
# A v that rounds to the code 0 beside a non-zero m would move it m / eps instead.

VOCAB, DIM, BLOCK = 64, 32, 256  # 8 rows per block
SPARSE_HYPER = dict(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0.0)


def sparse_row_grads(gen, steps):
    """Per step a VOCAB x DIM gradient: busy rows 0-3 and 8-9 every step (scale 1), a
    silent row (5, in a busy block) with a 1e-3 gradient at steps 1 and 7 only, and
    rare tokens: 3 random rows of the rest a step at scales down to 1e-4."""
    out = []
    for s in range(1, steps + 1):
        g = torch.zeros(VOCAB, DIM)
        g[[0, 1, 2, 3, 8, 9]] = torch.randn(6, DIM, generator=gen)
        if s in (1, 7):
            g[5] = 1e-3 * torch.randn(DIM, generator=gen)
        rare = torch.randint(10, VOCAB, (3,), generator=gen)
        g[rare] = torch.randn(3, DIM, generator=gen) * \
            10 ** -torch.randint(0, 5, (3, 1), generator=gen).float()
        out.append(g)
    return out


def largest_move_over_lr(make, grads):
    """The largest |change| of any element in any step, over lr, of make(params)."""
    p = torch.nn.Parameter(torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(3)))
    opt = make([p])
    worst = 0.0
    for g in grads:
        before = p.detach().clone()
        p.grad = g.clone()
        opt.step()
        worst = max(worst, (p.detach() - before).abs().max().item())
    return worst / SPARSE_HYPER["lr"]


def test_adamw8bit_on_sparse_rows_steps_like_its_float64_transcription():
    """Every step of the optimizer against the float64 transcription from the same
    state (codes, scales, parameter): parameters to fp32 rounding, codes equal off
    the midpoints. And the transcription run with v rounded to the plain nearest
    code (0 allowed) does jump on these gradients: the case the rule is for."""
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    gen = torch.Generator().manual_seed(seed)
    grads = sparse_row_grads(gen, 10)
    h = SPARSE_HYPER
    p = torch.nn.Parameter(torch.randn(VOCAB, DIM, generator=gen))
    opt = rfsdp.optim.AdamW8bit([p], lr=h["lr"], betas=(h["b1"], h["b2"]), eps=h["eps"],
                                weight_decay=h["wd"], block=BLOCK, min_8bit_size=1)
    code1, code2 = rfsdp.quant.dynamic_map(True), rfsdp.quant.dynamic_map(False)
    ids = block_ids(VOCAB, DIM, BLOCK)
    plain_jump = 0.0
    plain = (p.detach().reshape(-1).double(), torch.full((VOCAB * DIM,), 127, dtype=torch.long),
             torch.zeros(len(ids.unique())), torch.zeros(VOCAB * DIM, dtype=torch.long),
             torch.zeros(len(ids.unique())))
    for step, g in enumerate(grads, 1):
        st = {k: t.clone() for k, t in opt.sharded_state(p).items()}
        p0 = p.detach().reshape(-1).clone()
        want = adamw8bit_reference(p0, g.reshape(-1), st["q1"], st["absmax1"], st["q2"],
                                   st["absmax2"], ids, code1, code2, step=step, **h)
        p.grad = g.clone()
        opt.step()
        wp, c1, amb1, _, c2, amb2, _ = want
        msg = "seed %d step %d" % (seed, step)
        # fp32 against float64: to 1e-5 of a step (more where b1 m and (1 - b1) g cancel)
        torch.testing.assert_close(p.detach().reshape(-1).double(), wp, rtol=1e-6,
                                   atol=1e-5 * h["lr"], msg=lambda m: msg + ": " + m)
        now = opt.sharded_state(p)
        for q, c, amb in ((now["q1"], c1, amb1), (now["q2"], c2, amb2)):
            differ = q.long() != c
            assert not (differ & ~amb).any(), "%s: %d codes differ off the midpoints" % (
                msg, int((differ & ~amb).sum()))
        # the transcription alone, v rounded to the plain nearest code (the old rounding)
        pp, q1p, a1p, q2p, a2p = plain
        wpp, c1p, _, (am1p, _), c2p, _, (am2p, _) = adamw8bit_reference(
            pp, g.reshape(-1), q1p, a1p, q2p, a2p, ids, code1, code2, step=step,
            keep_nonzero=False, **h)
        plain_jump = max(plain_jump, (wpp - pp).abs().max().item() / h["lr"])
        plain = (wpp, c1p, am1p, c2p, am2p)
    assert plain_jump > 10, "seed %d: these gradients never exercise a v rounded to 0 (%g)" % (
        seed, plain_jump)


def test_adamw8bit_on_sparse_rows_moves_no_element_further_than_exact_adamw_allows():
    """Exact AdamW (torch's) bounds each step at about lr; 8-bit codes may add their
    rounding (the first moment's code up to twice a tiny m, the second's never
    below v): no step of AdamW8bit more than twice exact AdamW's largest."""
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    grads = sparse_row_grads(torch.Generator().manual_seed(seed), 12)
    h = SPARSE_HYPER
    exact = largest_move_over_lr(lambda ps: torch.optim.AdamW(
        ps, lr=h["lr"], betas=(h["b1"], h["b2"]), eps=h["eps"], weight_decay=h["wd"]), grads)
    eight = largest_move_over_lr(lambda ps: rfsdp.optim.AdamW8bit(
        ps, lr=h["lr"], betas=(h["b1"], h["b2"]), eps=h["eps"], weight_decay=h["wd"],
        block=BLOCK, min_8bit_size=1), grads)
    assert exact < 1.5, "seed %d: exact AdamW moved %g lr" % (seed, exact)
    assert eight <= 2 * exact, "seed %d: AdamW8bit moved an element %g lr in one step " \
        "(exact AdamW: %g)" % (seed, eight, exact)


@pytest.mark.parametrize("name", ["AdamW8bit", "Muon", "SOAP", "quantize"])
def test_device_generic_path_equals_the_cpu_kernels_bit_for_bit(name):
    # What a GPU without a kernel runs (rfsdp.quant.use_device_generic_path: ATen
    # operations), here on the CPU from Python: parameters and every state tensor
    # after 4 steps equal the CPU kernels' run bit for bit.
    seed = int(torch.randint(0, 2 ** 30, ()).item())

    def run():
        g = torch.Generator().manual_seed(seed)
        if name == "quantize":
            x = torch.randn(37, 530, generator=g) * torch.logspace(-6, 2, 530)
            q, a = rfsdp.quant.quantize_blockwise(x, (32, 32))
            return [q, a, rfsdp.quant.dequantize_blockwise(q, a, (32, 32))]
        ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(64, 40), (33, 96)]]
        opt = {"AdamW8bit": lambda: rfsdp.optim.AdamW8bit(ps, lr=1e-2, min_8bit_size=256),
               "Muon": lambda: rfsdp.optim.Muon(ps, lr=0.02, momentum_dtype="int8",
                                                momentum_block=64),
               "SOAP": lambda: rfsdp.optim.SOAP(ps, lr=1e-2, state_dtype="int8",
                                                max_preconditioner_dim=16,
                                                precondition_frequency=2)}[name]()
        for _ in range(4):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        return [p.detach().clone() for p in ps] + [
            t.clone() for p in ps for t in opt.state[p].values() if torch.is_tensor(t)]

    kernels = run()
    rfsdp.quant.use_device_generic_path(True)
    try:
        assert rfsdp.quant.device_generic_path()
        generic = run()
    finally:
        rfsdp.quant.use_device_generic_path(False)
    assert len(generic) == len(kernels) > 2
    for k, (a, b) in enumerate(zip(generic, kernels)):
        assert torch.equal(a, b), "%s: tensor %d differs (seed %d)" % (name, k, seed)
