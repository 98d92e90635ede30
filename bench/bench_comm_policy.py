"""Quantised collectives (rfsdp.CommPolicy), measured here and modelled at scale.

    python bench/bench_comm_policy.py [--elements N] [--world-size 1024]

1. The absmax code kernels (one thread): encode (fp32 weights -> codes and
   scales) and decode (codes -> the compute dtype), the CPU kernels and the
   device-generic ATen path, against a memcpy of the fp32 weights (the bytes a
   full-precision gather would copy in and out).
2. What one training step sends from each rank (two all-gathers, one
   reduce-scatter) for the zoo's Llama-3-70B and GPT-OSS-120B blocks at
   --world-size ranks, from the plan: compute dtype (bf16) weights, int8 or
   float8 codes of 256-element blocks (planned with the code blocks' granule:
   the padding it costs is shown), fp32 or bf16 gradients."""
import argparse
import json
import math
import os
import time

import torch

import rfsdp

HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 2 ** 20


def median_ms(fn, reps=21):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[reps // 2] * 1e3


def kernels(n):
    x = torch.randn(n)
    y = torch.empty_like(x)
    copy = median_ms(lambda: y.copy_(x))
    print("## 1. absmax codes, %d elements, one thread (memcpy of the fp32 weights: %.2f ms, %.1f GB/s)"
          % (n, copy, 2 * 4 * n / copy / 1e6))
    print("%-16s %-8s %12s %12s %14s %14s" % ("codes", "path", "encode ms", "decode ms",
                                            "encode/memcpy", "decode/memcpy"))
    dq = torch.empty(n, dtype=torch.bfloat16)
    for fmt in ("int8", "float8_e4m3fn"):
        policy = rfsdp.CommPolicy(weights=fmt)
        for generic in (False, True):
            rfsdp._C.use_device_generic_path(generic)
            enc = median_ms(lambda: rfsdp._C.quantize_weight_blocks(x, policy))
            codes, scales = rfsdp._C.quantize_weight_blocks(x, policy)
            dec = median_ms(lambda: rfsdp._C.dequantize_weight_blocks(codes, scales, policy, dq))
            # memcpy speed over the time: > 1 would be faster than copying the fp32 weights
            print("%-16s %-8s %12.2f %12.2f %14.2f %14.2f" % (fmt, "generic" if generic else "cpu", enc,
                                                            dec, copy / enc, copy / dec))
        rfsdp._C.use_device_generic_path(False)


def zoo_bytes(world, block=256):
    print("\n## 2. bytes sent per rank per step at %d ranks (2 all-gathers + 1 reduce-scatter, "
          "each rank's slice to the m-1 others), from the plan" % world)
    print("%-26s %-26s %9s %12s %12s %12s" % ("model block", "weights / gradients", "padding",
                                              "gathers MiB", "reduce MiB", "total MiB"))
    for name in ("llama3_70b.block", "gpt_oss_120b.block"):
        tensors = json.load(open(os.path.join(HERE, "zoo", name + ".json")))
        plain = rfsdp.plan(tensors, world)
        coded = []
        for t in tensors:  # the code blocks' granule (rfsdp.policy.blockwise_8bit's), by lcm
            row = math.prod(t["shape"][t["row_dims"]:]) if len(t["shape"]) > 1 else 1
            g = rfsdp._C.granule_rows(block, row)
            coded.append(dict(t, granule_rows=math.lcm(t["granule_rows"], g)))
        blocked = rfsdp.plan(coded, world)
        assert blocked.block_cut(block) is None
        for label, plan, code_block in (("bf16", plain, 0), ("int8 / float8 codes", blocked, block)):
            for grads, gbytes in (("fp32", 4), ("bf16", 2)):
                # (core/ragged/step_model.h's formulas, as FSDPUnit counts them)
                gathers = 2 * plan.gather_bytes(weight_bytes=2, code_block=code_block) / MIB
                reduce = plan.reduce_bytes(grad_bytes=gbytes) / MIB
                print("%-26s %-26s %8.3f%% %12.1f %12.1f %12.1f" % (
                    name, label + " / " + grads, 100 * plan.padding_fraction, gathers, reduce,
                    gathers + reduce))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=int, default=1 << 22)
    ap.add_argument("--world-size", type=int, default=1024)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("torch %s, %s" % (torch.__version__, open("/proc/cpuinfo").read().split("model name")[1]
                            .split("\n")[0].strip(" :\t")))
    kernels(args.elements)
    zoo_bytes(args.world_size)


if __name__ == "__main__":
    main()
