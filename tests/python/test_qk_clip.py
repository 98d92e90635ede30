"""QK-clip (rfsdp.optim.qk_clip_, Muon.qk_clip) against a float64 reference
written from the definition (Kimi K2's per-head rule; grouped-query attention as
Megatron-LM's clip_qk: a key head's group takes its worst query head's factor), in
one process (separate and fused weights, multi-head and grouped-query), and on 2
ranks with rfsdp.fully_shard cutting a head and with torch's FSDP2, each rank's
logits its own (the MAX all-reduce makes them global)."""
import os
import sys

import pytest
import torch
from torch import nn

import rfsdp

sys.path.insert(0, os.path.dirname(__file__))
from ranks import assert_raised, raised, run_ranks  # noqa: E402

HEAD = 4          # rows per head
N_Q, N_KV = 9, 3  # query heads, key heads (grouped-query: 3 query heads per key head)
QPK = N_Q // N_KV
D = 8             # columns (the model width)
TAU = 10.0


def reference(w, logits, q_rows, k_rows, q_per_kv, tau=TAU, alpha=0.5):
    """The clipped weight in float64, head by head from the definition: for key
    head g, S = max of its query heads' logits; if S > tau, eta = tau / S, its
    query heads' rows times eta**alpha, its rows times eta**(1 - alpha)."""
    w = w.double().clone()
    n_kv = (k_rows[1] - k_rows[0]) // HEAD
    for g in range(n_kv):
        heads = range(g * q_per_kv, (g + 1) * q_per_kv)
        s = max(float(logits[h]) for h in heads)
        if s <= tau:
            continue
        eta = tau / s
        for h in heads:
            r = q_rows[0] + h * HEAD
            w[r:r + HEAD] *= eta ** alpha
        r = k_rows[0] + g * HEAD
        w[r:r + HEAD] *= eta ** (1 - alpha)
    return w


def logits_of(seed):
    """Per query head max logits, some above TAU and some below."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(N_Q, generator=g) * 3 * TAU


FUSED_Q = (0, N_Q * HEAD)
FUSED_K = (N_Q * HEAD, N_Q * HEAD + N_KV * HEAD)
FUSED_ROWS = N_Q * HEAD + 2 * N_KV * HEAD  # q, k, v


def check(got, want, rows=None):
    torch.testing.assert_close(got.double(), want, rtol=2e-7, atol=0)


def test_mha_separate_weights_one_process():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(N_Q * HEAD, D, generator=g)
    k = torch.randn(N_Q * HEAD, D, generator=g)
    m = logits_of(1)
    want_q = reference(torch.cat([q, k]), m, (0, N_Q * HEAD), (N_Q * HEAD, 2 * N_Q * HEAD), 1)
    eta = rfsdp.optim.qk_clip_(q, k, m, TAU, HEAD)
    check(torch.cat([q, k]), want_q)
    assert (eta < 1).any() and (eta == 1).any()  # (both kinds of head were there)


def test_gqa_fused_qkv_one_process_leaves_v_alone():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(FUSED_ROWS, D, generator=g)
    v = w[FUSED_K[1]:].clone()
    m = logits_of(3)
    want = reference(w, m, FUSED_Q, FUSED_K, QPK)
    rfsdp.optim.qk_clip_(w, w, m, TAU, HEAD, q_per_kv=QPK, q_rows=FUSED_Q, k_rows=FUSED_K)
    check(w, want)
    assert torch.equal(w[FUSED_K[1]:], v)


def test_alpha_splits_the_factor():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(FUSED_ROWS, D, generator=g)
    m = logits_of(5)
    want = reference(w, m, FUSED_Q, FUSED_K, QPK, alpha=0.25)
    rfsdp.optim.qk_clip_(w, w, m, TAU, HEAD, q_per_kv=QPK, q_rows=FUSED_Q, k_rows=FUSED_K, alpha=0.25)
    check(w, want)


def test_bfloat16_weight_rounds_once():
    g = torch.Generator().manual_seed(6)
    w = torch.randn(FUSED_ROWS, D, generator=g).bfloat16()
    m = logits_of(7)
    want = reference(w, m, FUSED_Q, FUSED_K, QPK).bfloat16()
    rfsdp.optim.qk_clip_(w, w, m, TAU, HEAD, q_per_kv=QPK, q_rows=FUSED_Q, k_rows=FUSED_K)
    assert torch.equal(w, want)


def test_muon_method_and_its_errors():
    model = nn.Linear(D, FUSED_ROWS, bias=False)
    opt = rfsdp.optim.Muon(model.parameters(), lr=0.02)
    w0 = model.weight.detach().clone()
    m = logits_of(8)
    eta = opt.qk_clip([(model.weight, model.weight, HEAD, QPK, FUSED_Q, FUSED_K)], [m], TAU)
    check(model.weight.detach(), reference(w0, m, FUSED_Q, FUSED_K, QPK))
    assert eta[0].shape == (N_Q,)
    other = nn.Parameter(torch.randn(FUSED_ROWS, D))
    with pytest.raises(ValueError, match="not a parameter of this optimizer"):
        opt.qk_clip([(other, other, HEAD, QPK, FUSED_Q, FUSED_K)], [m], TAU)


@pytest.mark.parametrize("bad, match", [
    (dict(threshold=0.0), "threshold must be a finite number > 0"),
    (dict(max_logits=torch.ones(12)), r"rows \[0, 36\) \(of 60\) must hold 12 heads"),
    (dict(max_logits=torch.tensor([1.0, float("nan"), 2.0] * 3)), "hold NaN or Inf"),
    (dict(q_per_kv=4), "not a multiple of q_per_kv=4"),
    (dict(k_rows=(20, 32)), "overlap"),
])
def test_bad_arguments(bad, match):
    w = torch.randn(FUSED_ROWS, D)
    w0 = w.clone()
    args = dict(max_logits=logits_of(9), threshold=TAU, q_per_kv=QPK, q_rows=FUSED_Q, k_rows=FUSED_K)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        rfsdp.optim.qk_clip_(w, w, args.pop("max_logits"), args.pop("threshold"), HEAD, **args)
    assert torch.equal(w, w0)  # nothing was clipped


class Attn(nn.Module):
    """A fused grouped-query QKV weight and a bias (another tensor of the unit)."""

    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.qkv = nn.Parameter(torch.randn(FUSED_ROWS, D, generator=g))
        self.bias = nn.Parameter(torch.randn(D, generator=g))


def ranks_worker(rank, world, seed, kind):
    """The fused weight sharded by rfsdp.fully_shard or FSDP2, QK-clipped with this
    rank's own logits: (the clipped weight whole, every rank's rows of it, the
    logits of every rank, what a bad threshold raised)."""
    model = Attn(seed)
    if kind == "ddp":  # every rank holds the whole weight (a DDP replica)
        rows = [(0, FUSED_ROWS)] * world
    elif kind == "rfsdp":
        rfsdp.fully_shard(model)
        rows = rfsdp.shard_info(model.qkv).rank_rows
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        from rfsdp.fsdp.dtensor import chunk_rows
        rows = chunk_rows(FUSED_ROWS, world)
    mine = logits_of(100 + rank)
    all_logits = torch.stack([logits_of(100 + r) for r in range(world)])
    rfsdp.optim.qk_clip_(model.qkv, model.qkv, mine, TAU, HEAD, q_per_kv=QPK, q_rows=FUSED_Q,
                         k_rows=FUSED_K)
    bad = raised(rfsdp.optim.qk_clip_, model.qkv, model.qkv, mine * float("nan"), TAU, HEAD,
                 q_per_kv=QPK, q_rows=FUSED_Q, k_rows=FUSED_K)
    if kind == "ddp":
        whole = model.qkv.detach().clone()
    elif kind == "rfsdp":
        whole = rfsdp.full_parameters(model)["qkv"]
    else:
        whole = model.qkv.full_tensor()
    return whole, [tuple(r) for r in rows], all_logits, bad


@pytest.mark.parametrize("kind", ["rfsdp", "fsdp2"])
def test_two_ranks_cut_head_matches_reference(kind):
    seed = 11
    out = run_ranks(ranks_worker, 2, seed, kind)
    rows = out[0][1]
    # A rank boundary falls inside a query or key head: the head is clipped in two pieces.
    cuts = [b for b, _ in rows[1:] if b < FUSED_K[1] and b % HEAD]
    assert cuts, rows
    check_ranks(out)


def check_ranks(out):
    seed = 11
    m = out[0][2].amax(dim=0)
    want = reference(Attn(seed).qkv.detach(), m, FUSED_Q, FUSED_K, QPK)
    for whole, _, _, bad in out:
        check(whole, want)
        assert_raised(bad, ValueError, "hold NaN or Inf")


def test_two_ranks_ddp_replicas_clip_alike_with_the_global_logits():
    check_ranks(run_ranks(ranks_worker, 2, 11, "ddp"))


# Tensor parallelism: separate q and k weights (torchtitan's wq, wk), ColwiseParallel
# over tp (each tp rank its query heads and their key head), then rfsdp.fully_shard
# or torch FSDP2 over dp; mesh (dp=2, tp=2). Each rank has the logits of its own
# heads only (-inf for the others'); the MAX all-reduce over every rank merges them.
TP_Q, TP_KV = 4, 2  # query heads, key heads (2 query heads a key head: whole groups per tp rank)


class QK(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(D, TP_Q * HEAD, bias=False)
        self.wk = nn.Linear(D, TP_KV * HEAD, bias=False)


def tp_worker(rank, world, seed, kind):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(seed)
    model = parallelize_module(QK(), mesh["tp"], {"wq": ColwiseParallel(), "wk": ColwiseParallel()})
    if kind == "rfsdp":
        rfsdp.fully_shard(model, mesh=mesh["dp"])
    else:
        from torch.distributed.fsdp import fully_shard
        fully_shard(model, mesh=mesh["dp"])
    per = TP_Q // 2
    t = mesh["tp"].get_local_rank()
    mine = torch.full((TP_Q,), float("-inf"))
    mine[t * per:(t + 1) * per] = (torch.rand(TP_Q, generator=torch.Generator().manual_seed(
        100 + rank)) * 3 * TAU)[t * per:(t + 1) * per]
    rfsdp.optim.qk_clip_(model.wq.weight, model.wk.weight, mine, TAU, HEAD, q_per_kv=TP_Q // TP_KV)
    if kind == "rfsdp":
        whole = rfsdp.full_parameters(model)
    else:
        whole = {n: p.full_tensor() for n, p in model.named_parameters()}
    return whole, mine


@pytest.mark.parametrize("kind", ["rfsdp", "fsdp2"])
def test_tensor_parallel_heads_match_reference(kind):
    out = run_ranks(tp_worker, 4, 3, kind)
    torch.manual_seed(3)
    start = QK()
    w = torch.cat([start.wq.weight.detach(), start.wk.weight.detach()])
    m = torch.stack([mine for _, mine in out]).amax(dim=0)
    assert bool(torch.isfinite(m).all())
    want = reference(w, m, (0, TP_Q * HEAD), (TP_Q * HEAD, (TP_Q + TP_KV) * HEAD),
                     TP_Q // TP_KV)
    for whole, _ in out:
        check(torch.cat([whole["wq.weight"], whole["wk.weight"]]), want)
    assert not torch.equal(want.float(), w)  # (some head was clipped: the test can fail)
