"""QK-clip (Kimi K2's MuonClip): after an optimizer step, each attention head whose
largest pre-softmax logit exceeded a threshold has its query and key rows scaled
down, so that its logits shrink back to the threshold.

For a query head h with max logit S_h (over this step's batches, every
data-parallel rank's) and threshold t: eta_h = min(1, t / S_h); its query rows
are multiplied by eta_h ** alpha and its key head's rows by eta_h ** (1 - alpha)
(alpha 0.5: both by sqrt(eta_h), so q.k scales by eta_h). Grouped-query
attention (q_per_kv query heads share a key head, query head h using key head
h // q_per_kv, as torch's and Hugging Face's repeat_kv lay them out) follows
Megatron-LM's `--qk-clip` (SelfAttention.clip_qk): a group's eta is that of its
worst query head, min(1, t / max over the group of S_h), and it scales every
query head of the group and their key head alike. With q_per_kv = 1 (multi-head
attention) that is Kimi's per-head rule.

Works wherever the ranks hold the rows: a plain tensor (one process, or a
DDP replica: every rank scales all of it alike), rfsdp.fully_shard's shards and
FSDP2's Shard(0) DTensors (each rank scales the rows it holds, a head that a
shard boundary cuts on each piece: the rows' global places come from the
parameter's shard descriptor, the one the optimizers use), tensor parallelism's
ColwiseParallel query and key weights (each tp rank its heads; its logits of
the others' heads -inf, so the all-reduce merges them). No parameter moves;
the only collective is one MAX all-reduce of the logits of every attention
clipped in the call, over the data-parallel group, unless they are already
global (logits_global=True)."""
import math

import torch
import torch.distributed as dist

from ..fsdp.dtensor import info_of, local


class QKPair:
    """One attention's query and key weights as QK-clip sees them.

    q, k: the parameters holding the query and key rows ([out, in]: rows are
    output features, head h's rows [h * head_dim, (h + 1) * head_dim) of the
    block); the same tensor for a fused QKV weight, with q_rows / k_rows the
    (begin, end) rows of each block (a GPT's c_attn [3 d, d]: q_rows=(0, d),
    k_rows=(d, 2 d)); default: all rows. head_dim: rows per head. q_per_kv: query
    heads per key head (grouped-query attention; 1: multi-head)."""

    __slots__ = ("q", "k", "head_dim", "q_per_kv", "q_rows", "k_rows")

    def __init__(self, q, k, head_dim, q_per_kv=1, q_rows=None, k_rows=None):
        self.q, self.k, self.head_dim, self.q_per_kv = q, k, head_dim, q_per_kv
        self.q_rows, self.k_rows = q_rows, k_rows


def _rows_of(name, p):
    """(this rank's rows of p as a [rows, row_len] view, the global index of its
    first row, p's global rows): from p's shard descriptor where it has one
    (fully_shard's, an FSDP2 DTensor's), else p whole."""
    info = info_of(name, p)
    t = local(p.data)
    if info is None:
        if t.dim() != 2:
            raise ValueError("qk_clip_: %s must be a matrix [out, in], got shape %s"
                             % (name, tuple(t.shape)))
        return t, 0, t.shape[0]
    if len(info.global_shape) != 2 or info.row_dims != 1:
        raise ValueError("qk_clip_: %s must be a matrix [out, in], got shape %s"
                         % (name, tuple(info.global_shape)))
    return t.view(-1, info.row_len), info.row_begin, info.full_rows


def _block(name, rows, full, head_dim, heads):
    """(begin, end) of a block of `heads` heads of head_dim rows, checked."""
    b, e = (0, full) if rows is None else (int(rows[0]), int(rows[1]))
    if not 0 <= b <= e <= full or e - b != heads * head_dim:
        raise ValueError("qk_clip_: %s rows [%d, %d) (of %d) must hold %d heads of %d rows (%d "
                         "rows)" % (name, b, e, full, heads, head_dim, heads * head_dim))
    return b, e


def _scale_rows(t, first, block, head_dim, factors):
    """Multiplies the rows of `block` that t holds (t: rows [first, first +
    t.shape[0]) of the tensor) by their head's factor (float32, rounded once into
    t's dtype)."""
    b = max(block[0], first)
    e = min(block[1], first + t.shape[0])
    if e <= b:
        return
    heads = (torch.arange(b, e, device=factors.device) - block[0]) // head_dim
    rows = t[b - first:e - first]
    rows.copy_(rows.float() * factors[heads].unsqueeze(1))


def _check_logits(max_logits, what):
    m = torch.as_tensor(max_logits).detach()
    if m.dim() != 1 or m.numel() == 0:
        raise ValueError("qk_clip_: the max logits of %s must be a 1-D tensor, one per query "
                         "head, got shape %s" % (what, tuple(m.shape)))
    return m


@torch.no_grad()
def qk_clip_many_(pairs, max_logits, threshold, *, alpha=0.5, logits_global=False,
                  process_group=None):
    """QK-clip of several attentions (pairs: QKPair each; max_logits: one tensor
    of per-query-head max logits each) with one MAX all-reduce for all of them.
    Returns each attention's eta per query head (float32, 1 where not clipped)."""
    pairs, logits = list(pairs), list(max_logits)
    if len(pairs) != len(logits):
        raise ValueError("qk_clip_: %d attentions and %d max-logit tensors" % (len(pairs),
                                                                              len(logits)))
    try:
        threshold = float(threshold)
    except (TypeError, ValueError):
        threshold = float("nan")
    if not (math.isfinite(threshold) and threshold > 0):
        raise ValueError("qk_clip_: threshold must be a finite number > 0, got %r" % (threshold,))
    if not 0.0 <= alpha <= 1.0:
        raise ValueError("qk_clip_: alpha must be in [0, 1], got %r" % (alpha,))
    plans = []
    for j, (a, m) in enumerate(zip(pairs, logits)):
        what = "attention %d" % j
        if not (isinstance(a.head_dim, int) and a.head_dim > 0 and isinstance(a.q_per_kv, int)
                and a.q_per_kv > 0):
            raise ValueError("qk_clip_: %s: head_dim and q_per_kv must be positive integers, got "
                             "%r and %r" % (what, a.head_dim, a.q_per_kv))
        m = _check_logits(m, what)
        n_q = m.numel()
        if n_q % a.q_per_kv:
            raise ValueError("qk_clip_: %s has %d query heads, not a multiple of q_per_kv=%d"
                             % (what, n_q, a.q_per_kv))
        q, q0, q_full = _rows_of("the query weight of %s" % what, a.q)
        k, k0, k_full = _rows_of("the key weight of %s" % what, a.k)
        qb = _block("the query weight of %s:" % what, a.q_rows, q_full, a.head_dim, n_q)
        kb = _block("the key weight of %s:" % what, a.k_rows, k_full, a.head_dim,
                    n_q // a.q_per_kv)
        if a.q is a.k and qb[0] < kb[1] and kb[0] < qb[1]:
            raise ValueError("qk_clip_: %s: the query rows [%d, %d) and key rows [%d, %d) of the "
                             "fused weight overlap" % (what, qb[0], qb[1], kb[0], kb[1]))
        plans.append((a, q, q0, qb, k, k0, kb))
        logits[j] = m
    sizes = [m.numel() for m in logits]
    all_logits = torch.cat([m.float().reshape(-1) for m in logits]) if logits else torch.zeros(0)
    if not logits_global:
        group = process_group
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        if group is not None and dist.get_world_size(group) > 1:
            # (Gloo takes CPU tensors, NCCL the current GPU's: the weights' device)
            dev = plans[0][1].device if plans else all_logits.device
            buf = all_logits.to(dev)
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
            all_logits = buf
    if all_logits.numel() and not bool(torch.isfinite(all_logits).all()):
        bad = [j for j, m in enumerate(all_logits.split(sizes)) if not torch.isfinite(m).all()]
        raise ValueError("qk_clip_: the max logits of attention %d hold NaN or Inf (after the "
                         "all-reduce: on some rank): nothing was clipped" % bad[0])
    out = []
    for (a, q, q0, qb, k, k0, kb), m in zip(plans, all_logits.split(sizes)):
        # A group's eta: its worst query head's (Megatron's grouped clip_qk).
        group_max = m.view(-1, a.q_per_kv).amax(dim=1)
        eta_kv = torch.clamp(threshold / group_max.clamp_min(threshold), max=1.0)
        eta_q = eta_kv.repeat_interleave(a.q_per_kv)
        dev = q.device
        _scale_rows(q, q0, qb, a.head_dim, eta_q.to(dev).pow(alpha))
        _scale_rows(k, k0, kb, a.head_dim, eta_kv.to(k.device).pow(1.0 - alpha))
        out.append(eta_q)
    return out


def qk_clip_(q_weight, k_weight, max_logits, threshold, head_dim, *, q_per_kv=1, q_rows=None,
             k_rows=None, alpha=0.5, logits_global=False, process_group=None):
    """QK-clip of one attention, in place (see the module's doc): every query head
    h whose max logit S_h (max_logits[h], this rank's batches unless
    logits_global) exceeds `threshold` t has its query rows scaled by
    min(1, t/S)**alpha and its key head's rows by min(1, t/S)**(1 - alpha), S the
    largest of the query heads that share the key head (q_per_kv per key head).
    q_weight, k_weight: the parameters (plain, rfsdp.fully_shard's, FSDP2's
    DTensors), the same one for a fused QKV with q_rows and k_rows its blocks'
    (begin, end) rows. process_group: where the logits' MAX all-reduce runs
    (default: torch.distributed's default group when initialised: every
    data-parallel rank's batches). Returns eta per query head (float32)."""
    return qk_clip_many_([QKPair(q_weight, k_weight, head_dim, q_per_kv, q_rows, k_rows)],
                         [max_logits], threshold, alpha=alpha, logits_global=logits_global,
                         process_group=process_group)[0]
