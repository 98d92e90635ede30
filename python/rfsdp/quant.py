"""Block-wise 8-bit quantisation (bitsandbytes' dynamic map, 1-D blocks or 2-D tiles), on
CPU tensors (the CPU kernels), CUDA tensors (the CUDA kernels, on the current stream) or
any other device (the device-generic path: ATen operations); all give the same bits."""
from . import _C


def dynamic_map(signed=True):
    """bitsandbytes' create_dynamic_map(signed, 7, 8): 256 float32 values."""
    return _C.dynamic_map(bool(signed))


def _code(code, signed):
    return _C.code_map(code, bool(signed)) if isinstance(code, str) else code


def quantize_blockwise(x, block=256, code="dynamic", signed=True, keep_nonzero=False):
    """-> (codes uint8 of x's shape, absmax float32 per block). code: a map's name
    ("dynamic", "linear"), 256 values, or "float8_e4m3fn" (codes are the e4m3 bits
    of x * 448 / absmax, rounded as torch's cast; signed is then unused). block: an int
    (1-D blocks of the flattened tensor) or a pair (tiles of x seen as rows x
    its last dim). keep_nonzero (unsigned codes): a value above 0 never takes
    the code 0, as the 8-bit optimizers store second moments (a v stored as 0
    beside a non-zero first moment would turn m / (sqrt(v) + eps) into m / eps)."""
    if isinstance(code, str) and code == "float8_e4m3fn":
        return _C.quantize_blockwise_fp8(x, block, keep_nonzero=keep_nonzero)
    return _C.quantize_blockwise(x, _code(code, signed), block, keep_nonzero=keep_nonzero)


def dequantize_blockwise(codes, absmax, block=256, code="dynamic", signed=True, shape=None,
                         out=None):
    """-> float32 values (codes' shape, or `shape`); into `out` (float32, contiguous,
    as many elements) when given, so repeated calls reuse one buffer."""
    if isinstance(code, str) and code == "float8_e4m3fn":
        res = _C.dequantize_blockwise_fp8(codes, absmax, block, out=out)
    else:
        res = _C.dequantize_blockwise(codes, absmax, _code(code, signed), block, out=out)
    return res.reshape(shape) if shape is not None else res


def use_device_generic_path(on=True):
    """Run every quantised operation (8-bit optimizer states, the weights' codes under
    a CommPolicy) on the device-generic path: ATen operations only, what a device with
    no kernel for an operation runs, bit for bit the CPU and CUDA kernels. On the CPU
    it is for tests and checks (it is much slower than the kernels);
    RFSDP_DEVICE_GENERIC=1 at import does the same."""
    _C.use_device_generic_path(bool(on))


def device_generic_path():
    """Whether use_device_generic_path is on."""
    return _C.device_generic_path()
