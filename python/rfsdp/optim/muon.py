"""Muon with its AdamW part over the C++ Muon (optimizers/muon)."""
import warnings

import torch

from .. import _C
from ..policy import is_matrix
from .base import _OverCpp, bool_option


class Muon(_OverCpp):
    """Muon over ragged shards, with AdamW for the parameters outside Muon groups
    (as the reference Muon's MuonWithAuxAdam): groups with use_muon=False take
    AdamW's lr, betas, eps and weight_decay (defaults 3e-4, (0.9, 0.95), 1e-10, 0).
    A group that does not say (no use_muon, as Muon(model.parameters())) gives its
    matrices to Muon and its 0-D and 1-D parameters (biases, norms) to AdamW with
    the group's lr and weight_decay and betas (0.9, 0.95), eps 1e-10 unless the
    group sets them (reported once, as a warning); use_muon=True makes every
    parameter of the group Muon's (a 1-D one is then an error).

    Each step: momentum on the local shard; every matrix's update gathered to its
    root rank (one all-to-all), orthogonalised there by Newton–Schulz, scattered
    back (one all-to-all); p <- p (1 - lr wd) - lr o. Matrices: 2-D weights; a 3-D
    [E, H, I] expert stack is E matrices H x I; more dims are (dim 0, rest). A 0-D
    or 1-D parameter in a Muon group is an error. adjust_lr: "original" scales
    the update by max(1, rows/cols)^0.5; "match_rms_adamw" by 0.2 sqrt(max(rows,
    cols)) (Moonlight; reuse AdamW's lr and weight decay). A group's split_sizes
    (row counts along dim 0, summing to the rows; a 3-D stack: each expert's rows)
    makes every block its own matrix for Newton–Schulz and adjust_lr: heads are
    [head_dim] * n_heads, a grouped-query fused QKV [n_q * head_dim] +
    [n_kv * head_dim] * 2 (as dion's split_sizes). A group's split_dim=1 makes
    split_sizes count columns instead (GPT-2's Conv1D stores c_attn.weight as
    [in, 3 * in]: its heads are [head_dim] * 3 * n_heads column blocks); each
    column block is orthogonalised alone and scaled by adjust_lr on its own
    shape as stored (rows x block columns: "original" gives max(1, in /
    head_dim)^0.5 there, where the same head of an nn.Linear's [out, in] weight
    gets 1; "match_rms_adamw" is symmetric). A block one rank holds whole is
    orthogonalised there and moves nothing; column blocks span every row, so a
    matrix whose rows ranks cut goes whole to its root (plan it whole with
    rfsdp.policy.muon(split=..., split_dim=1)). ns_dtype: Newton–Schulz
    compute dtype (default: bfloat16 for parameters on a GPU, float32 on the CPU).
    ns_coefficients: Newton–Schulz's (a, b, c), in torch.optim.Muon's form (one
    tuple for every iteration; default Keller Jordan's quintic (3.4445, -4.775,
    2.0315)), a list of them (one per iteration), or "polar_express" (Amsel et
    al., arXiv 2505.16932: five per-iteration tuples, X / (1.02 |X|_F + 1e-6);
    ns_steps <= 5). adjust_lr_fn: torch.optim.Muon's name for adjust_lr.
    On a GPU the matrices of equal shape rooted on a rank (an expert stack, the
    layers' projections) are orthogonalised as one batch (bmm).

    momentum_dtype: the momentum's storage. torch.float32; torch.bfloat16 (updated
    in fp32, stored rounded); or "int8": 8-bit block-wise codes, blocks of
    momentum_block elements of the global (flattened) tensor with one fp32 absmax
    each and the signed code map momentum_map ("dynamic": bitsandbytes' dynamic
    map, "linear": 256 even steps in [-1, 1], "float8_e4m3fn": e4m3 codes of the
    momentum times 448 / absmax, by arithmetic), dequantised, updated and encoded in
    one pass on the owning shard; the update is taken from the fp32 momentum
    before it is encoded, and what is gathered to the roots is unchanged. Codes
    and scales do not depend on the world size; "int8" needs shards of whole
    blocks (plan with rfsdp.policy.combine(rfsdp.policy.muon(...),
    rfsdp.policy.blockwise_8bit(momentum_block))) and runs on the CPU.

    hyperball (a group option; MuonH, "Fantastic Pretraining Optimizers II"): every
    Muon parameter keeps its Frobenius norm R, hyperball_radius (None: its norm
    when the optimizer first steps it, kept in the state as "hyperball_radius",
    saved and resharded by state_dict and rfsdp.checkpoint). With d the update
    before lr (Newton–Schulz's output with adjust_lr's scale; its split_sizes
    blocks and experts together: norms are per parameter), u = d / (|d|_F + 1e-8),
    W <- W - lr R u, W <- R W / (|W|_F + 1e-8). weight_decay must be 0 in such a
    group (an error otherwise); use_muon=False groups take no Hyperball (their
    weight decay stays; hyperball=True there is an error). A parameter ranks cut (rows on several ranks)
    needs |W|^2, <W, d> and |d|^2 summed across them: one float64 all-reduce a
    step for every such parameter (normalise_bytes() says how many bytes this
    rank sent); one held whole needs none.

    Coming from torch.optim.Muon: the defaults differ (torch: lr=1e-3,
    weight_decay=0.1, bfloat16 Newton–Schulz; here lr=0.02, weight_decay=0.0,
    float32 on a CPU), so a swap changes the run unless they are given; with the
    same lr, weight_decay, ns_dtype and coefficients the two agree to rounding.
    torch's refuses 0-D and 1-D parameters; here a group that does not say
    gives them to AdamW (above).

    Collective: every rank builds it from the same model and steps together;
    process_group defaults to the shard group of fully_shard's parameters (under
    HSDP the roots are chosen inside it and each replica computes the same
    update), else torch.distributed's default group (none: one process).
    """

    AUX_DEFAULTS = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)
    _config_class = _C.MuonConfig

    def __init__(self, param_groups, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5,
                 weight_decay=0.0, adjust_lr="original", process_group=None,
                 ns_dtype=None, timeout_seconds=300.0, momentum_dtype=torch.float32,
                 momentum_block=256, momentum_map="dynamic", rounding="nearest",
                 ns_coefficients=None, adjust_lr_fn=None, hyperball=False,
                 hyperball_radius=None):
        self.rounding = rounding  # (checked in C++ when bound)
        if adjust_lr_fn is not None:  # torch.optim.Muon's name for adjust_lr
            if adjust_lr not in ("original", adjust_lr_fn):
                raise ValueError("Muon: adjust_lr=%r and adjust_lr_fn=%r disagree: give one"
                                 % (adjust_lr, adjust_lr_fn))
            adjust_lr = adjust_lr_fn
        groups = list(param_groups)
        if groups and not isinstance(groups[0], dict):
            groups = [dict(params=groups)]
        groups = [dict(g) for g in groups]
        for g in groups:
            if g.get("use_muon") is not None and not g["use_muon"]:
                for k, v in self.AUX_DEFAULTS.items():
                    g.setdefault(k, v)
                if g.get("hyperball"):
                    raise ValueError("%s: hyperball applies to Muon's matrices; a use_muon=False "
                                     "group takes AdamW (rfsdp.optim.AdamW(hyperball=True) is "
                                     "AdamH)" % type(self).__name__)
                g["hyperball"] = False  # (the optimizer's hyperball=True is its matrices')
        # use_muon None (a group that does not say): matrices Muon, the rest AdamW
        super().__init__(groups, dict(lr=lr, momentum=momentum, nesterov=nesterov,
                                      ns_steps=ns_steps, weight_decay=weight_decay,
                                      adjust_lr=adjust_lr, use_muon=None, split_sizes=None,
                                      split_dim=0, hyperball=hyperball,
                                      hyperball_radius=hyperball_radius, **self._extra_defaults))
        auto = sum(1 for g in self.param_groups if g["use_muon"] is None
                   for p in g["params"] if not _takes_muon(g, p))
        if auto:
            warnings.warn("Muon: %d 0-D and 1-D parameters (biases, norms) of groups without "
                          "use_muon take AdamW with their group's lr and weight_decay, betas %s "
                          "and eps %g; give them a use_muon=False group to choose otherwise"
                          % (auto, self.AUX_DEFAULTS["betas"], self.AUX_DEFAULTS["eps"]),
                          stacklevel=2)
        if ns_dtype is None:
            on_gpu = any(p.device.type == "cuda" for g in self.param_groups for p in g["params"])
            ns_dtype = torch.bfloat16 if on_gpu else torch.float32
        self.config = _C.MuonConfig(ns_dtype=ns_dtype, momentum_dtype=momentum_dtype,
                                    momentum_block=momentum_block, momentum_map=momentum_map,
                                    ns_coefficients=ns_coefficients, **self._config_extra)
        self._set_groups(process_group, timeout_seconds)
        self._bind()

    _options_class = _C.MuonOptions
    _extra_defaults = {}  # (NorMuon's beta2 and eps)
    _config_extra = {}

    def _group_options(self, g):
        return dict(lr=g["lr"], momentum=g["momentum"], weight_decay=g["weight_decay"],
                    nesterov=bool_option(type(self).__name__, g, "nesterov", self.defaults.get("nesterov", True)), adjust_lr=g["adjust_lr"],
                    betas=g.get("betas", self.AUX_DEFAULTS["betas"]),
                    eps=g.get("eps", self.AUX_DEFAULTS["eps"]),
                    hyperball=bool_option(type(self).__name__, g, "hyperball"),
                    hyperball_radius=g.get("hyperball_radius"))

    def normalise_bytes(self):
        """Bytes this rank sent in the last step's all-reduce of Hyperball's and
        NorMuon's norms (the parameters ranks cut; 0: none)."""
        self._bind()
        return self._impl.normalise_bytes()

    def _make_impl(self, params):
        group_of = self._group_of()
        use = [_takes_muon(group_of[id(p)], p) for p in params]
        # One C++ optimizer over both parts: one step, one agreement all-reduce
        # (NaN/Inf gradients and Newton-Schulz failures), so neither changes alone.
        self._splits = self._group_splits()
        specs = self._specs(params)
        self._check_copies(params, specs, use)
        return _C.Muon(specs, [group_of[id(p)]["ns_steps"] for p in params],
                       self.config, self.comm, use_muon=use,
                       split_sizes=[list(group_of[id(p)]["split_sizes"] or ()) if u else []
                                    for p, u in zip(params, use)],
                       split_dims=[_split_dim(group_of[id(p)]) if u else 0
                                   for p, u in zip(params, use)])

    def _check_copies(self, params, specs, use):
        """A Muon matrix that is a DTensor sharded over fewer ranks than this
        optimizer agrees over (one not tensor-parallel beside tensor-parallel ones:
        an MoE router, a layer left out of the tp plan) has copies of its pieces on
        the other ranks, which Newton-Schulz's owner exchange cannot take (each
        element on one rank): refused, naming it, before C++ says "do not tile"."""
        if self.comm is None or self._given_group is not None:
            return
        import torch.distributed as dist

        from ..fsdp.dtensor import info_of, is_dtensor, mesh_dims_of
        for p, (shard, _), u in zip(params, specs, use):
            info = info_of(shard.name, p) if u else None
            if info is None or mesh_dims_of(p, info) is None:
                continue
            n = dist.get_world_size(info.process_group) if info.process_group is not None else 1
            if n < self.comm.size():
                what = "a DTensor with placements %s over mesh dims %s" % (
                    tuple(p.placements), p.device_mesh.mesh_dim_names) if is_dtensor(p) else \
                    "a fully_shard shard over mesh dims %s" % (mesh_dims_of(p, info)[1],)
                raise ValueError(
                    "Muon: parameter '%s' (%s) is "
                    "sharded over %d of the %d ranks this optimizer agrees over (every mesh dim "
                    "some of its parameters is sharded on): the others hold copies of its "
                    "pieces, which Muon's owner exchange does not take; give such parameters a "
                    "Muon of their own (its group is then theirs), or parallelise them over "
                    "the other dims too (ColwiseParallel / RowwiseParallel)"
                    % (shard.name, what, n, self.comm.size()))

    def _group_splits(self):
        return [(None if g.get("split_sizes") is None else tuple(g["split_sizes"]),
                 g.get("split_dim", 0)) for g in self.param_groups]

    def _follow_params(self):
        """As the base's, and a group whose split_sizes changed rebuilds the C++
        Muon (its layout) with the state carried over."""
        if getattr(self, "_splits", None) is not None and self._group_splits() != self._splits:
            self._bind(force=True)
        super()._follow_params()

    def qk_clip(self, attentions, max_logits, threshold, *, alpha=0.5, logits_global=False,
                process_group=None):
        """QK-clip (Kimi K2's MuonClip) after a step, of this optimizer's attention
        weights: attentions, a list of rfsdp.optim.QKPair(q, k, head_dim, q_per_kv=1,
        q_rows=None, k_rows=None) (or tuples of those arguments) whose weights are
        parameters of this optimizer; max_logits, one tensor of per-query-head max
        logits each (this rank's batches unless logits_global: one MAX all-reduce
        for all of them over process_group, default torch.distributed's default
        group). Scales each clipped head's query and key rows where this rank holds
        them (rfsdp.optim.qk_clip_). Returns each attention's eta per query head."""
        from .qk_clip import QKPair, qk_clip_many_
        self._bind()
        pairs = [a if isinstance(a, QKPair) else QKPair(*a) for a in attentions]
        mine = {id(p) for p in self._bound_params}
        for j, a in enumerate(pairs):
            for what, p in (("query", a.q), ("key", a.k)):
                if id(p) not in mine:
                    raise ValueError("Muon.qk_clip: the %s weight of attention %d is not a parameter "
                                     "of this optimizer (after fully_shard, give the model's "
                                     "parameters as they are now)" % (what, j))
        return qk_clip_many_(pairs, max_logits, threshold, alpha=alpha,
                             logits_global=logits_global, process_group=process_group)

    # Group keys a checkpoint may not change: they shape the layout, not the state.
    _fixed_group_keys = ("split_sizes", "split_dim")


def _split_dim(group):
    d = group.get("split_dim", 0)
    if isinstance(d, bool) or d not in (0, 1):
        raise ValueError("Muon: a group's split_dim must be 0 (split_sizes count rows) or 1 "
                         "(columns: GPT-2's Conv1D weights, stored [in, out]), got %r" % (d,))
    return d


def _takes_muon(group, p):
    """use_muon True: Muon; False: AdamW; None (not said): Muon for matrices."""
    u = group["use_muon"]
    return is_matrix(None, p) if u is None else bool(u)


class NorMuon(Muon):
    """NorMuon (Li et al., arXiv 2510.05491; dion's NorMuon): Muon (every argument
    and the AdamW part as Muon's) whose Newton–Schulz output O (adjust_lr's
    scale in it) is normalised per row: v <- lerp(v, mean(O^2 over the
    columns), 1 - beta2), N = O / (sqrt(v) + eps), N <- N |O|_F / max(|N|_F,
    1e-8), then W <- W (1 - lr wd) - lr N. Per split_sizes block where a group
    gives them (the Frobenius rescale per block; column blocks, split_dim=1:
    the rows of each block). v is one float32 per row (per row and column
    block), "normuon_v" in the state, saved and resharded as the momentum; it
    stays float32 whatever momentum_dtype is (one value per row is a small
    part of the state). beta2 and eps are group options; NorMuon's eps is the
    group's "eps", so a group without use_muon gives its 0-D and 1-D
    parameters' AdamW the same eps (use_muon=False groups keep the AdamW
    part's own, default 1e-10). hyperball=True (Muon's) takes N as the direction.

    A matrix ranks cut has |O|^2 and |N|^2 of each block summed across them:
    one float64 all-reduce a step, with Hyperball's sums where both apply."""

    def __init__(self, param_groups, lr=0.02, momentum=0.95, beta2=0.95, eps=1e-8, **kw):
        self._extra_defaults = dict(beta2=beta2, eps=eps)
        self._config_extra = dict(normuon=True)
        super().__init__(param_groups, lr=lr, momentum=momentum, **kw)

    def _group_options(self, g):
        out = super()._group_options(g)
        out.update(normuon_beta2=g["beta2"], normuon_eps=g["eps"])
        return out
