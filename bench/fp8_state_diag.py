"""Where AdamW8bit's float8_e4m3fn states and the dynamic map differ (issue 57):
the main job's GPT (rfsdp.compare's model, data, WSD schedule, clip 1, AdamW's
settings) trained in one process by AdamW written out in torch, each moment of
every tensor with >= 4096 elements passed through a chosen block format (blocks
of 256 of the flattened tensor, rfsdp.quant's kernels) after every step, as
AdamW8bit stores them: so m and v can take different formats (fp8 m with
dynamic v, ...), which the optimizer itself does not offer, and candidate v
formats can be tried before a kernel is written. Recorded per step (means over
the coded tensors, reported per quarter of the run): for v, the fraction above
0 that decoded to the smallest fp8 code (the keep_nonzero clamp) and the error
of one round trip of sqrt(v); against fp32 shadows of m and v fed the same
gradients, the relative error of m (norm), of sqrt(v) (mean |.| and signed
mean) and of the update m / (sqrt(v) + eps) (norm). One seed's validation loss
is noise here (two seeds of the real runs differ by 0.02): read the errors.

  python bench/fp8_state_diag.py --m dyn --v fp8 --seeds 0 --lr 0.016

Formats: fp32 (no coding), dyn (the dynamic map: signed for m, unsigned with
keep_nonzero for v), fp8 (e4m3 of x * 448 / absmax; v keep_nonzero), fp8sqrt
(v only: e4m3 of sqrt(v) * 448 / absmax of sqrt(v), decoded and squared), e4m4
(v only, emulated: e4m3's unused sign bit as a 4th mantissa bit), fp8sr (v
only, emulated: e4m3 codes rounded stochastically, torch's generator)."""
import argparse
import json
import math

import torch
from torch import nn

from rfsdp import quant
from rfsdp.compare import config as C
from rfsdp.compare.gpt import GPT, VOCAB, batches, load_text, split_text

BLOCK = 256
MIN_8BIT = 4096


def code(x, fmt, is_v):
    """x after a round trip through fmt (x flattened to blocks of 256)."""
    if fmt == "fp32":
        return x
    flat = x.reshape(-1)
    if fmt == "dyn":
        q, a = quant.quantize_blockwise(flat, BLOCK, "dynamic", signed=not is_v, keep_nonzero=is_v)
        return quant.dequantize_blockwise(q, a, BLOCK, "dynamic", signed=not is_v).view_as(x)
    if fmt == "fp8":
        q, a = quant.quantize_blockwise(flat, BLOCK, "float8_e4m3fn", keep_nonzero=is_v)
        return quant.dequantize_blockwise(q, a, BLOCK, "float8_e4m3fn").view_as(x)
    if fmt == "fp8sqrt" and is_v:
        q, a = quant.quantize_blockwise(flat.sqrt(), BLOCK, "float8_e4m3fn", keep_nonzero=True)
        return quant.dequantize_blockwise(q, a, BLOCK, "float8_e4m3fn").square().view_as(x)
    if fmt == "e4m4" and is_v:
        # v >= 0 leaves e4m3's sign bit unused: emulated as a 4th mantissa bit (5
        # significant bits, round to nearest even; the same 448 / absmax scale)
        vb = flat.reshape(-1, BLOCK)
        amax = vb.amax(1, keepdim=True)
        r = torch.where(amax > 0, 448.0 / amax, torch.zeros_like(amax))
        y = (vb * r).double()
        mant, ex = torch.frexp(y)
        ex = ex.clamp(min=-5)  # e4m3's subnormal floor 2^-6 (ulp 2^-9 -> 2^-10 here)
        yq = torch.round(torch.ldexp(y, 5 - ex)) * torch.pow(2.0, (ex - 5).double())
        yq = torch.where((yq == 0) & (y > 0), torch.full_like(yq, 2.0 ** -10), yq)
        return (yq.float() * torch.where(amax > 0, amax / 448.0, amax)).view_as(x)
    if fmt == "fp8sr" and is_v:
        # e4m3 codes of v * 448 / absmax rounded stochastically (up with probability
        # the distance from the code below over the gap; torch's global generator):
        # unbiased, so an increment smaller than half the grid's step survives on average
        vb = flat.reshape(-1, BLOCK)
        amax = vb.amax(1, keepdim=True)
        y = vb * torch.where(amax > 0, 448.0 / amax, torch.zeros_like(amax))
        c = y.to(torch.float8_e4m3fn).view(torch.uint8).int()
        near = c.to(torch.uint8).view(torch.float8_e4m3fn).float()
        lo_c = torch.where(near > y, c - 1, c).clamp(min=0)
        hi_c = (lo_c + 1).clamp(max=126)
        lo = lo_c.to(torch.uint8).view(torch.float8_e4m3fn).float()
        hi = hi_c.to(torch.uint8).view(torch.float8_e4m3fn).float()
        up = torch.rand_like(y) * (hi - lo) < (y - lo)
        yq = torch.where(up, hi, lo)
        yq = torch.where((yq == 0) & (y > 0), torch.full_like(yq, 2.0 ** -9), yq)
        return (yq * torch.where(amax > 0, amax / 448.0, amax)).view_as(x)
    raise ValueError("format %r for %s" % (fmt, "v" if is_v else "m"))


def v_stats(v, vq):
    """(fraction of v > 0 that decoded to its block's smallest code, mean |sqrt(vq)/sqrt(v) - 1|
    over v > 0): the smallest code is where decode < 2^-9 * 1.5 * absmax / 448 (fp8) -
    measured as vq's value at or below its block's minimum positive value for any format."""
    pos = v > 0
    if not pos.any():
        return 0.0, 0.0
    vb, qb = v.reshape(-1, BLOCK), vq.reshape(-1, BLOCK)
    amax = vb.amax(1, keepdim=True)
    # e4m3's smallest code 2^-9 times the block's scale absmax / 448
    floor = amax * (2.0 ** -9) / 448.0 * 1.0001
    clamp = ((qb <= floor) & (vb > 0)).sum().item() / pos.sum().item()
    rel = ((vq[pos].sqrt() / v[pos].sqrt()) - 1).abs().mean().item()
    return clamp, rel


def run(args, seed):
    torch.manual_seed(seed)
    cfg = dict(width=128, layers=2, heads=4, ctx=64)
    model = GPT(cfg["width"], cfg["layers"], cfg["heads"], cfg["ctx"])
    train, val = split_text(load_text("fortunes"))
    gen = torch.Generator().manual_seed(seed * 1000)
    batch = args.batch_tokens // cfg["ctx"]
    total = args.budget // args.batch_tokens
    sched = dict(kind="wsd", warmup_fraction=0.1, decay_fraction=0.2)
    b1, b2, eps, wd = 0.9, 0.999, 1e-8, 0.1
    params = list(model.parameters())
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    # fp32 shadows of the coded moments, fed the same gradients: what coding changed
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]
    data = batches(train, batch, cfg["ctx"], gen)
    stats = []
    for step in range(1, total + 1):
        x, y = next(data)
        loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        model.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        lr = args.lr * C.lr_factor(sched, min(step - 1, total - 1), total)
        bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
        clamp_sum, rel_sum, n8 = 0.0, 0.0, 0
        em_sum, ev_sum, eu_sum, eb_sum = 0.0, 0.0, 0.0, 0.0
        with torch.no_grad():
            for p, mi, vi, msi, vsi in zip(params, m, v, ms, vs):
                g = p.grad
                mi.mul_(b1).add_(g, alpha=1 - b1)
                vi.mul_(b2).addcmul_(g, g, value=1 - b2)
                if p.numel() >= MIN_8BIT:
                    msi.mul_(b1).add_(g, alpha=1 - b1)
                    vsi.mul_(b2).addcmul_(g, g, value=1 - b2)
                    # relative errors against the shadows: m (norm), sqrt(v) (mean over
                    # elements), and the update m / (sqrt(v') + eps) (norm)
                    em_sum += ((mi - msi).norm() / msi.norm()).item() * p.numel()
                    pos = vsi > 0
                    rel = vi[pos].sqrt() / vsi[pos].sqrt() - 1
                    ev_sum += rel.abs().mean().item() * p.numel()
                    eb_sum += rel.mean().item() * p.numel()
                    uq = mi / (vi.sqrt() / math.sqrt(bc2) + eps)
                    us = msi / (vsi.sqrt() / math.sqrt(bc2) + eps)
                    eu_sum += ((uq - us).norm() / us.norm()).item() * p.numel()
                p.mul_(1 - lr * wd)
                p.addcdiv_(mi, vi.sqrt() / math.sqrt(bc2) + eps, value=-lr / bc1)
                if p.numel() >= MIN_8BIT:
                    vq = code(vi, args.v, True)
                    c, r = v_stats(vi, vq)
                    clamp_sum += c * p.numel()
                    rel_sum += r * p.numel()
                    n8 += p.numel()
                    mi.copy_(code(mi, args.m, False))
                    vi.copy_(vq)
        stats.append((loss.item(), clamp_sum / n8, rel_sum / n8, em_sum / n8, ev_sum / n8,
                      eu_sum / n8, eb_sum / n8))
    model.eval()
    with torch.no_grad():
        n = args.val_tokens // cfg["ctx"]
        xs = torch.stack([val[j * cfg["ctx"]:(j + 1) * cfg["ctx"]] for j in range(n)])
        ys = torch.stack([val[j * cfg["ctx"] + 1:(j + 1) * cfg["ctx"] + 1] for j in range(n)])
        tot = 0.0
        for i in range(0, n, 64):
            tot += nn.functional.cross_entropy(model(xs[i:i + 64]).reshape(-1, VOCAB),
                                               ys[i:i + 64].reshape(-1), reduction="sum").item()
        vl = tot / (n * cfg["ctx"])
    k = max(1, total // 4)
    q = [stats[i * k:(i + 1) * k] for i in range(4)]
    return dict(seed=seed, val_loss=vl,
                v_clamped_by_quarter=[sum(s[1] for s in qq) / len(qq) for qq in q if qq],
                sqrt_v_rel_err_by_quarter=[sum(s[2] for s in qq) / len(qq) for qq in q if qq],
                shadow_m_err_by_quarter=[sum(s[3] for s in qq) / len(qq) for qq in q if qq],
                shadow_sqrt_v_err_by_quarter=[sum(s[4] for s in qq) / len(qq) for qq in q if qq],
                shadow_sqrt_v_bias_by_quarter=[sum(s[6] for s in qq) / len(qq) for qq in q if qq],
                shadow_update_err_by_quarter=[sum(s[5] for s in qq) / len(qq) for qq in q if qq])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", default="dyn", choices=["fp32", "dyn", "fp8"])
    ap.add_argument("--v", default="dyn", choices=["fp32", "dyn", "fp8", "fp8sqrt", "e4m4", "fp8sr"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--lr", type=float, default=0.008)
    ap.add_argument("--budget", type=int, default=524288)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--val-tokens", type=int, default=65536)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res = [run(args, s) for s in args.seeds]
    mean = sum(r["val_loss"] for r in res) / len(res)
    print(json.dumps(dict(m=args.m, v=args.v, lr=args.lr, budget=args.budget, mean_val_loss=mean,
                          runs=res)))


if __name__ == "__main__":
    main()
