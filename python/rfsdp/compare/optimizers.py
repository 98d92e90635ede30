"""The optimizers a comparison (and the main job, examples/train_gpt.py) builds:
names, the ":variant" table of low-bit states, each optimizer's settings, and the
sharding policy each one needs. One home for what both use."""
import torch

from .. import optim, policy as _policy

OPTIMIZERS = ["adamw", "adamw8bit", "muon", "normuon", "shampoo", "soap"]
# Muon's family: Muon's groups (matrices Muon, the rest its AdamW part) and policy.
MUON_LIKE = ("muon", "normuon")
# Low-bit state variants, named optimizer:variant (muon:int8): the optimizer's own
# settings with these changed.
# Hyperball (MuonH, AdamH: the matrices keep their norms) is a variant too:
# hyperball=True, no weight decay on the matrices.
HYPERBALL = dict(hyperball=True, weight_decay=0.0)
VARIANTS = {
    "adamw": {"hyperball": HYPERBALL},
    # fp8: float8_e4m3fn codes (decoded by arithmetic) in place of the dynamic map.
    "adamw8bit": {"hyperball": HYPERBALL, "fp8": dict(state_format="float8_e4m3fn")},
    "normuon": {"hyperball": HYPERBALL},
    "muon": {"hyperball": HYPERBALL, "bf16": dict(momentum_dtype=torch.bfloat16),
             "int8": dict(momentum_dtype="int8"),
             "int8-linear": dict(momentum_dtype="int8", momentum_map="linear"),
             "fp8": dict(momentum_dtype="int8", momentum_map="float8_e4m3fn"),
             "heads": {}},  # per-head Q, K and V (split_sizes; the plan keeps heads whole)
    "shampoo": {"bf16": dict(factor_dtype=torch.bfloat16), "int8-bases": dict(basis_dtype="int8"),
                "int4-bases": dict(basis_dtype="int4")},
    "soap": {"bf16": dict(factor_dtype=torch.bfloat16, basis_dtype=torch.bfloat16),
             "int8": dict(state_dtype="int8"),
             "fp8": dict(state_dtype="int8", state_format="float8_e4m3fn"),
             "int8-bases": dict(basis_dtype="int8"),
             "int4-bases": dict(basis_dtype="int4")},
}
# Each optimizer's settings where a caller gives none: the main job's.
#  muon: Muon on the blocks' matrices, AdamW (adam_*) on embeddings, head, norms
#        and biases; weight decay per step at lr 0.02 (lr * wd) equal to AdamW's at
#        3e-3 and 0.1.
#  shampoo: Adam grafting (the update has AdamW's size, so AdamW's learning rate);
#        tiles of at most 256; roots every 10 steps from step 10; epsilon 1e-10.
#  soap: Adam in Shampoo's eigenbasis on the same tiles, refresh every 10; betas
#        (0.9, 0.99) (with SOAP's own (0.95, 0.95) the main job ends at validation
#        loss 2.797, with these at 2.640; AMD EPYC, 150 steps).
DEFAULTS = {
    "adamw": dict(weight_decay=0.1),
    "adamw8bit": dict(weight_decay=0.1),
    "muon": dict(momentum=0.95, weight_decay=0.015, adam_lr=3e-3, adam_betas=(0.9, 0.999),
                 adam_eps=1e-8, adam_weight_decay=0.1),
    "normuon": dict(momentum=0.95, weight_decay=0.015, adam_lr=3e-3, adam_betas=(0.9, 0.999),
                    adam_eps=1e-8, adam_weight_decay=0.1),
    "shampoo": dict(betas=(0.9, 0.999), epsilon=1e-10, weight_decay=0.1,
                    max_preconditioner_dim=256, precondition_frequency=10),
    "soap": dict(betas=(0.9, 0.99), weight_decay=0.1, max_preconditioner_dim=256,
                 precondition_frequency=10),
}
DTYPE_KEYS = ("momentum_dtype", "factor_dtype", "basis_dtype", "state_dtype", "ns_dtype")


def parse_name(name):
    """'muon:int8' -> ('muon', 'int8', its settings); ValueError naming the choices."""
    base, _, variant = str(name).partition(":")
    if base not in OPTIMIZERS or (variant and variant not in VARIANTS.get(base, {})):
        raise ValueError("unknown optimizer %r (choose from %s, or these variants: %s)"
                         % (name, ", ".join(OPTIMIZERS), ", ".join(
                             "%s:%s" % (b, v) for b in VARIANTS for v in VARIANTS[b])))
    return base, variant, dict(VARIANTS.get(base, {}).get(variant, {}))


def _dtype(v):
    """'bfloat16' -> torch.bfloat16 (floating dtypes by name); 'int8', 'int4' (block
    codes) and dtypes as they are."""
    t = getattr(torch, v, None) if isinstance(v, str) else None
    if isinstance(t, torch.dtype) and t.is_floating_point:
        return t
    return v


def settings(name, **given):
    """The keyword arguments `name` is built with: DEFAULTS, then `given`, then the
    variant's (a variant names what it changes). Lists become tuples (betas from
    JSON), dtype names dtypes."""
    base, _, low_bit = parse_name(name)
    out = dict(DEFAULTS[base])
    out.update(given)
    out.update(low_bit)
    for k, v in list(out.items()):
        if isinstance(v, list):
            out[k] = tuple(v)
        if k in DTYPE_KEYS:
            out[k] = _dtype(v)
    if base == "shampoo":
        out.setdefault("start_preconditioning_step", out["precondition_frequency"])
    return out


def head_split(model):
    """Rows of each head of the fused QKV ([head_dim] * 3 * heads) for the main job's
    GPT (muon:heads), or None for a model without `blocks` of fused `qkv`."""
    blocks = getattr(model, "blocks", None)
    if not blocks or not hasattr(blocks[0], "qkv") or not hasattr(blocks[0], "heads"):
        return None
    d = blocks[0].qkv.weight.shape[1]
    return [d // blocks[0].heads] * (3 * blocks[0].heads)


def policy_for(name, model=None, **given):
    """The plan's policy `name` needs: AdamW any row boundary; AdamW8bit whole 8-bit
    blocks; Muon any boundary (cut matrices go to a root), plus whole 8-bit blocks
    for 8-bit momentum and whole heads for muon:heads; Shampoo and SOAP whole tiles."""
    base, variant, _ = parse_name(name)
    kw = settings(name, **given)
    if base == "adamw":
        return _policy.adamw()
    if base == "adamw8bit":
        return _policy.blockwise_8bit(kw.get("block", 256))
    if base in MUON_LIKE:
        parts = [_policy.muon()]
        if kw.get("momentum_dtype") == "int8":
            parts.append(_policy.blockwise_8bit(kw.get("momentum_block", 256)))
        if variant == "heads":
            per_head = head_split(model)
            if per_head is None:
                raise ValueError("muon:heads needs a model whose blocks hold a fused qkv "
                                 "(the main job's GPT)")
            parts.append(_policy.muon(split=lambda n, p: per_head if n.endswith("qkv.weight")
                                      else None))
        return _policy.combine(*parts) if len(parts) > 1 else parts[0]
    return _policy.shampoo(kw["max_preconditioner_dim"])


def muon_matrices(model):
    """The parameters Muon orthogonalises: the 2-D parameters of the blocks
    (`model.blocks`), or, for a model without blocks, the weights of every nn.Linear
    but the last (the head); a model may name them itself (`muon_parameters()`)."""
    if hasattr(model, "muon_parameters"):
        return list(model.muon_parameters())
    if hasattr(model, "blocks"):
        return [p for b in model.blocks for p in b.parameters() if p.dim() == 2]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return [m.weight for m in linears[:-1]]


MUON_AUX = ("adam_lr", "adam_betas", "adam_eps", "adam_weight_decay")


def allowed_keywords(name):
    """The keywords `name` takes (its constructor's, less params and process group;
    Muon's AdamW group's adam_*)."""
    import inspect
    base, _, _ = parse_name(name)
    cls = {"adamw": optim.AdamW, "adamw8bit": optim.AdamW8bit, "muon": optim.Muon,
           "normuon": optim.NorMuon, "shampoo": optim.Shampoo, "soap": optim.SOAP}[base]
    skip = {"self", "params", "param_groups", "process_group", "kw"}
    out = [k for k in inspect.signature(cls.__init__).parameters if k not in skip]
    if base == "normuon":  # (its other keywords are Muon's)
        out += [k for k in allowed_keywords("muon") if k not in out and k not in MUON_AUX]
    return out + list(MUON_AUX) if base in MUON_LIKE else out


def make_optimizer(name, model, lr, **given):
    """rfsdp.optim's optimizer for `name` ('adamw', 'muon:int8', ...) over the (sharded)
    model's parameters, with learning rate lr and `settings(name, **given)`. Muon's
    lr and weight_decay are its matrices'; adam_lr, adam_betas, adam_eps and
    adam_weight_decay its AdamW group's (embeddings, head, norms, biases)."""
    base, variant, _ = parse_name(name)
    kw = settings(name, **given)
    if base in MUON_LIKE:
        per_head = head_split(model) if variant == "heads" else None
        matrices = muon_matrices(model)
        qkv = [b.qkv.weight for b in model.blocks] if per_head else []
        ids = {id(p) for p in matrices}
        rest = [p for p in model.parameters() if id(p) not in ids]
        # (Hyperball is the matrices': the AdamW group keeps its weight decay)
        aux = dict(params=rest, use_muon=False, lr=kw.pop("adam_lr"), betas=kw.pop("adam_betas"),
                   eps=kw.pop("adam_eps"), weight_decay=kw.pop("adam_weight_decay"))
        split = [dict(params=qkv, use_muon=True, split_sizes=per_head)] if per_head else []
        groups = split + [dict(params=[p for p in matrices if all(p is not q for q in qkv)],
                               use_muon=True), aux]
        return (optim.NorMuon if base == "normuon" else optim.Muon)(groups, lr=lr, **kw)
    cls = {"adamw": optim.AdamW, "adamw8bit": optim.AdamW8bit, "shampoo": optim.Shampoo,
           "soap": optim.SOAP}[base]
    return cls(model.parameters(), lr=lr, **kw)
