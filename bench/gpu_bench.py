"""The GPU path measured on one GPU, side by side in one run (scripts/gpu_check.sh
runs it): 8-bit kernels against a device-to-device copy of the same bytes,
Newton–Schulz against torch.mm on the same products, a GPT step with rfsdp, torch
FSDP2 and plain PyTorch (time, peak memory), and the overlap prefetch buys.
Times are medians of CUDA-event timings after warm-up; ratios are what to read.
Prints a markdown table; --out FILE writes it there too. --rehearse: every line on
the CPU with tiny sizes (the suite runs it, so the GPU run does not fail on the
bench's own code); its figures mean nothing."""
import argparse
import copy
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

import rfsdp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
from train_gpt import GPT  # noqa: E402

ROWS = []
DEV = torch.device("cuda")  # the CPU in a rehearsal (main)


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def row(section, what, value, reference, ratio, note=""):
    ROWS.append((section, what, value, reference, ratio, note))
    print("| %s | %s | %s | %s | %s | %s |" % ROWS[-1], flush=True)


def median_ms(fn, reps=20, warm=3):
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        if DEV.type != "cuda":
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_ms(nbytes):
    """A device-to-device copy moving nbytes in all (half read, half written)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    return median_ms(lambda: dst.copy_(src))


def quantise_into(x, code, block, row_len, q, a):
    if DEV.type == "cuda":
        rfsdp._C.cuda_quantize_into(x, code, block, row_len, q, a)
    else:  # the rehearsal: the CPU's entry point
        codes, absmax = rfsdp._C.quantize_blockwise(x, code, block, row_len)
        q.copy_(codes.reshape(-1))
        a.copy_(absmax.reshape(-1))


def dequantise_into(q, a, code, block, row_len, out):
    if DEV.type == "cuda":
        rfsdp._C.cuda_dequantize_into(q, a, code, block, row_len, out)
    else:
        rfsdp._C.dequantize_blockwise(q, a, code, block, row_len, out)


def bench_8bit(n):
    dev = DEV
    code1, code2 = rfsdp.quant.dynamic_map(True).to(dev), rfsdp.quant.dynamic_map(False).to(dev)
    for block, row_len in ((256, 1), ((32, 32), 8192)):
        nb = rfsdp._C.num_blocks(block, n // row_len, row_len)
        x = torch.randn(n, device=dev)
        q = torch.empty(n, dtype=torch.uint8, device=dev)
        a = torch.empty(nb, device=dev)
        out = torch.empty(n, device=dev)
        p, g = torch.randn(n, device=dev), 1e-3 * torch.randn(n, device=dev)
        q1 = torch.full((n,), 127, dtype=torch.uint8, device=dev)
        q2 = torch.zeros(n, dtype=torch.uint8, device=dev)
        a1, a2 = torch.zeros(nb, device=dev), torch.zeros(nb, device=dev)
        step = [0]

        def adamw():
            step[0] += 1
            rfsdp._C.adamw8bit_step(p, g, q1, a1, q2, a2, block, row_len, code1, code2, 1e-3, 0.9,
                                    0.999, 1e-8, 0.01, step[0])

        kernels = {
            "quantise": (lambda: quantise_into(x, code1, block, row_len, q, a),
                         4 * n + n + 4 * nb),
            "dequantise": (lambda: dequantise_into(q, a, code1, block, row_len, out),
                           n + 4 * nb + 4 * n),
            # param r/w, grad read, both codes r/w, both absmax r/w
            "fused AdamW8bit": (adamw, 8 * n + 4 * n + 4 * n + 16 * nb),
        }
        for name, (fn, nbytes) in kernels.items():
            t, tc = median_ms(fn), copy_ms(nbytes)
            row("8-bit", "%s, block %s, %d Mi elems" % (name, block, n >> 20),
                "%.0f GB/s" % (nbytes / t / 1e6), "copy %.0f GB/s" % (nbytes / tc / 1e6),
                "%.2f" % (tc / t), "target >= 0.8")


def ns_flops(rows, cols, steps):
    n, N = min(rows, cols), max(rows, cols)
    return steps * (4.0 * n * n * N + 2.0 * n ** 3)


def bench_newton_schulz(shapes, steps=5):
    for batch, rows, cols in shapes:
        shape = (rows, cols) if batch == 1 else (batch, rows, cols)
        x = torch.randn(shape, device=DEV)
        t = median_ms(lambda: rfsdp._C.newton_schulz(x, steps, "bfloat16"), reps=10)
        # torch.mm (bmm) on the products one iteration makes, in bf16: X X^T, A A, B X
        n, N = min(rows, cols), max(rows, cols)
        xb = torch.randn((batch, n, N), device=DEV, dtype=torch.bfloat16)
        ab = torch.randn((batch, n, n), device=DEV, dtype=torch.bfloat16)

        def products():
            torch.bmm(xb, xb.transpose(1, 2))
            torch.bmm(ab, ab)
            torch.bmm(ab, xb)

        tm = steps * median_ms(products, reps=10)
        f = batch * ns_flops(rows, cols, steps)
        row("Newton–Schulz", "%s %dx%d bf16, %d steps" % ("batch %d x" % batch if batch > 1 else "one",
                                                          rows, cols, steps),
            "%.0f TFLOP/s" % (f / t / 1e9), "torch.mm %.0f TFLOP/s" % (f / tm / 1e9),
            "%.2f" % (tm / t), "target >= 0.7")


def gpt_step_bench(d, layers, heads, ctx, batch, steps=10):
    torch.manual_seed(0)
    base = GPT(d, layers, heads, ctx)
    data = torch.randint(0, 256, (batch, ctx + 1), device=DEV)

    def loss_of(model):
        logits = model(data[:, :-1])
        return nn.functional.cross_entropy(logits.float().reshape(-1, 256), data[:, 1:].reshape(-1))

    results = {}

    def measure(name, model, opt, autocast=False):
        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast(DEV.type, torch.bfloat16, enabled=autocast):
                loss = loss_of(model)
            loss.backward()
            opt.step()
        for _ in range(3):
            step()
        sync()
        if DEV.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = median_ms(step, reps=steps, warm=0)
        peak = torch.cuda.max_memory_allocated() / 2 ** 30 if DEV.type == "cuda" else 0.0
        results[name] = (t, peak)
        return model

    def empty_cache():
        if DEV.type == "cuda":
            torch.cuda.empty_cache()

    plain = copy.deepcopy(base).to(DEV)
    measure("plain PyTorch (autocast bf16, fused AdamW)", plain,
            torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=True), autocast=True)
    del plain
    empty_cache()

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    f2 = copy.deepcopy(base).to(DEV)
    mp2 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in f2.blocks:
        fully_shard(b, mp_policy=mp2)
    fully_shard(f2, mp_policy=mp2)
    measure("torch FSDP2 (bf16 / fp32 reduce, AdamW foreach)", f2,
            torch.optim.AdamW(f2.parameters(), lr=1e-4))
    del f2
    empty_cache()

    r = copy.deepcopy(base).to(DEV)
    for b in r.blocks:
        rfsdp.fully_shard(b)  # the GPU default: bf16 compute, fp32 reduction
    rfsdp.fully_shard(r)
    opt = rfsdp.optim.AdamW(r.parameters(), lr=1e-4)
    measure("rfsdp (bf16 / fp32 reduce, fused AdamW)", r, opt)
    rfsdp.set_prefetch(r, False)
    measure("rfsdp, prefetch off", r, opt)
    del r, opt
    empty_cache()

    plain_t, plain_m = results["plain PyTorch (autocast bf16, fused AdamW)"]
    tag = "GPT d=%d L=%d ctx=%d batch=%d" % (d, layers, ctx, batch)
    for name, (t, m) in results.items():
        row("GPT step", "%s: %s" % (tag, name), "%.1f ms, %.2f GiB peak" % (t, m),
            "plain %.1f ms, %.2f GiB" % (plain_t, plain_m), "%.2f" % (plain_t / t),
            "time ratio plain/this")
    on, off = results["rfsdp (bf16 / fp32 reduce, fused AdamW)"][0], results["rfsdp, prefetch off"][0]
    row("overlap", tag + ": rfsdp step, prefetch on vs off", "%.1f ms" % on, "off %.1f ms" % off,
        "%.2f" % (off / on), "> 1: prefetch hides gathers (world size 1: gathers are copies)")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", help="write the markdown table here")
    ap.add_argument("--elems", type=int, default=1 << 26, help="8-bit kernels: elements")
    ap.add_argument("--quick", action="store_true", help="a small GPT only")
    ap.add_argument("--rehearse", action="store_true",
                    help="every line on the CPU with tiny sizes (figures meaningless)")
    args = ap.parse_args()
    global DEV
    if args.rehearse:
        DEV = torch.device("cpu")
        device_name = "the CPU (a rehearsal: the figures mean nothing)"
    else:
        assert torch.cuda.is_available(), "gpu_bench needs a CUDA device"
        device_name = torch.cuda.get_device_name()
    print("torch %s, %s" % (torch.__version__, device_name))
    print("| section | what | measured | reference | ratio | note |\n|---|---|---|---|---|---|")
    bench_8bit(1 << 16 if args.rehearse else args.elems)
    bench_newton_schulz(((1, 64, 96), (4, 32, 32)) if args.rehearse else
                        ((1, 4096, 4096), (1, 4096, 14336), (1, 1024, 4096), (32, 1024, 1024),
                         (16, 2048, 1408)))
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo" if args.rehearse else "nccl",
                                init_method="file://" + os.path.join(d, "init"), rank=0, world_size=1)
        try:
            if args.rehearse:
                gpt_step_bench(32, 2, 2, 16, 2, steps=2)
            else:
                gpt_step_bench(256, 4, 4, 128, 8)
            if not (args.quick or args.rehearse):
                gpt_step_bench(1024, 12, 16, 512, 8)
        finally:
            dist.destroy_process_group()
    if args.out:
        with open(args.out, "w") as f:
            f.write("GPU bench: torch %s on %s\n\n" % (torch.__version__, device_name))
            f.write("| section | what | measured | reference | ratio | note |\n|---|---|---|---|---|---|\n")
            for r in ROWS:
                f.write("| %s | %s | %s | %s | %s | %s |\n" % r)


if __name__ == "__main__":
    main()
