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


def nearest_code64(x, tol, code):
    """Index of the nearest code to each x (ties to the lower code), and whether x
    lies within tol (fp32's rounding of x) of the midpoint between two codes."""
    code = code.double()
    idx = torch.searchsorted(code, x).clamp(1, len(code) - 1)
    lo, hi = code[idx - 1], code[idx]
    pick_hi = (hi - x) < (x - lo)
    mid = (lo + hi) / 2
    ambiguous = (x - mid).abs() <= tol
    return torch.where(pick_hi, idx, idx - 1), ambiguous


def adamw8bit_reference(p, g, q1, a1, q2, a2, ids, code1, code2, lr, b1, b2, eps, wd, step):
    """float64: dequantise with the maps, torch.optim.AdamW's update, requantise
    each block by its absmax and the nearest code."""
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
    c2, amb2 = nearest_code64(x2, tol2 + 1e-12, code2)
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
