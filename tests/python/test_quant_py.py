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


def test_bad_input():
    with pytest.raises(ValueError, match="NaN or Inf"):
        rfsdp.quant.quantize_blockwise(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="float32"):
        rfsdp.quant.quantize_blockwise(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown code map"):
        rfsdp.quant.quantize_blockwise(torch.zeros(4), code="cubic")


def test_shard_cutting_a_block_is_refused_by_name():
    from rfsdp import _C
    _C.check_whole_blocks(256, "w", 300, 40, 32, 64)  # rows [32, 96): 1280-element edges
    with pytest.raises(ValueError, match="'w'.*32 rows"):
        _C.check_whole_blocks(256, "w", 300, 40, 5, 10)
    with pytest.raises(ValueError, match="'t'"):
        _C.check_whole_blocks((32, 32), "t", 96, 96, 0, 40)  # ends mid-tile
