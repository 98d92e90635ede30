"""Sharding policies: which granule (rows a rank boundary may fall at) each
parameter asks of the planner. A policy maps (name, parameter) to an int >= 1 or
"whole". Several users of one parameter combine by lcm (capped at the whole tensor)."""
import math

from . import _C

WHOLE = "whole"


def check_granule(g, name="?"):
    if g == WHOLE:
        return g
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        raise ValueError("parameter '%s': granule must be a positive integer or \"whole\", got %r"
                         % (name, g))
    return g


def row_len(param, row_dims=1):
    """Elements per row of param seen as rows of its first row_dims dims."""
    return _C.row_geometry(list(param.shape), min(row_dims, max(param.dim(), 1)))[1]


class Policy:
    """granule(name, param) -> int | "whole"; row_dims(name, param) -> 1 or 2.

    granule_fn(name, param) or granule_fn(name, param, row_dims): the second form
    (the granule depends on what a row is, as an 8-bit block's does) is asked in
    the row_dims that the plan uses, which combine() may take from another policy.
    row_dims_fn None: the policy has no preference (1 alone, any under combine).
    blocks_fn(name, param) -> counts or None: the parameter's logical blocks
    (Muon's split) along blocks_dim (0 rows, 1 columns), carried by the plan to
    the shards (TensorSpec::blocks).

    Names: fully_shard asks a policy with the names the module it shards gives
    its parameters, and again, for the parameters inner calls sharded, with the
    names each outer call's module gives them (the model's own
    named_parameters() at the outermost call), so a policy keyed by either finds
    them; an inner unit whose blocks only an outer name gives is planned again
    there. keys: the names the policy was given (a split dict's); those that no
    name ever matched are unmatched() (the optimizers refuse them: a typo would
    otherwise leave matrices unsplit without a word)."""

    def __init__(self, granule_fn, row_dims_fn=None, blocks_fn=None, blocks_dim=0, keys=()):
        import inspect
        self._granule = granule_fn
        self._row_dims = row_dims_fn
        self._blocks = blocks_fn
        self.blocks_dim = int(blocks_dim)
        self._keys = frozenset(keys)
        self._matched = set()   # keys a name has matched
        self._asked = set()     # every name the policy was asked about
        self._parts = ()        # the policies combine() made this of
        try:
            self._rows_aware = len(inspect.signature(granule_fn).parameters) >= 3
        except (TypeError, ValueError):
            self._rows_aware = False

    def granule(self, name, param, row_dims=None):
        rd = self.row_dims(name, param) if row_dims is None else row_dims
        g = self._granule(name, param, rd) if self._rows_aware else self._granule(name, param)
        return check_granule(g, name)

    def row_dims(self, name, param):
        return self._row_dims(name, param) if self._row_dims else 1

    def blocks(self, name, param):
        """The parameter's logical blocks (counts along blocks_dim), or None."""
        b = self._blocks(name, param) if self._blocks else None
        return None if b is None else [int(x) for x in b]

    def _lookup(self, table, name):
        """table.get(name), recording the name and the key it matched."""
        self._asked.add(name)
        if name in table:
            self._matched.add(name)
            return table[name]
        return None

    def asked(self):
        """Every name this policy (and those it combines) was asked about."""
        out = set(self._asked)
        for pol in self._parts:
            out |= pol.asked()
        return out

    def unmatched(self):
        """Keys of this policy (and of those it combines) that no name matched yet."""
        out = set(self._keys - self._matched)
        for pol in self._parts:
            out |= pol.unmatched()
        return out

    def check_matched(self, who="rfsdp.policy"):
        """Raises ValueError naming every key no parameter's name matched, with the
        nearest names the policy was asked about."""
        missing = sorted(self.unmatched())
        if not missing:
            return
        import difflib
        asked = sorted(self.asked())
        hints = []
        for key in missing:
            near = difflib.get_close_matches(key, asked, n=3, cutoff=0.5)
            hints.append("'%s'%s" % (key, " (nearest: %s)" % ", ".join("'%s'" % n for n in near)
                                     if near else ""))
        raise ValueError(
            "%s: the policy names %s, which match no parameter any fully_shard call planned "
            "with it (names as the sharded module or the model's named_parameters() give them, "
            "of matrices); nothing was split there: fix the names" % (who, ", ".join(hints)))


def adamw():
    """Plain AdamW: any row boundary (granule 1)."""
    return Policy(lambda name, p: 1)


def blockwise_8bit(block=None):
    """8-bit block-wise optimizer states: every shard starts on a block edge.
    block: int (1-D blocks of B elements: B / gcd(B, row length) rows) or (rows, cols)
    tiles; None: AdamW8bit's default block."""
    if block is None:
        block = _C.AdamW8bitConfig().settings()["block"]
    blk = block if isinstance(block, int) else tuple(int(b) for b in block)

    def granule(name, p, row_dims):
        return _C.granule_rows(blk, row_len(p, row_dims))  # quant::BlockShape::granule_rows
    return Policy(granule)


def combine(*policies):
    """Granules of several users, by lcm ("whole" wins), each in the row_dims that
    the policies with a preference agree on (they must: a ValueError otherwise;
    none has one: 1)."""
    def row_dims(name, p):
        wants = {pol._row_dims(name, p) for pol in policies if pol._row_dims}
        if len(wants) > 1:
            raise ValueError("policy.combine: parameter '%s' (shape %s) is asked to be planned "
                             "as rows of %s leading dims by different policies; combine "
                             "policies that agree on it" % (name, tuple(p.shape),
                                                            " and ".join(map(str, sorted(wants)))))
        return wants.pop() if wants else 1

    def granule(name, p, rd):
        gs = [pol.granule(name, p, rd) for pol in policies]
        if WHOLE in gs:
            return WHOLE
        return math.lcm(*gs)

    def blocks(name, p):
        given = {(tuple(b), pol.blocks_dim) for b, pol in ((pol.blocks(name, p), pol)
                                                            for pol in policies) if b is not None}
        if len(given) > 1:
            raise ValueError("policy.combine: parameter '%s' is given different logical blocks: %s"
                             % (name, " and ".join("%s (split_dim %d)" % (list(b), d)
                                                   for b, d in sorted(given))))
        return list(given.pop()[0]) if given else None
    dims = {pol.blocks_dim for pol in policies if pol._blocks}
    if len(dims) > 1:
        raise ValueError("policy.combine: policies split logical blocks along different dims "
                         "(split_dim %s); combine policies that agree" % sorted(dims))
    out = Policy(granule, row_dims if any(pol._row_dims for pol in policies) else None,
                 blocks if any(pol._blocks for pol in policies) else None,
                 blocks_dim=dims.pop() if dims else 0)
    out._parts = tuple(policies)
    return out


def shampoo(max_preconditioner_dim=1024):
    """Shampoo: every preconditioner tile (at most B x B of a matrix; a 3-D
    [E, H, I] stack is E matrices H x I) lies on one rank. 2-D: rank boundaries
    every B rows; 3-D: rows of the first 2 dims, boundaries every B rows of an
    expert when H is a multiple of B, else between experts; 1-D: anywhere."""
    b = int(max_preconditioner_dim)
    if b < 1:
        raise ValueError("policy.shampoo: max_preconditioner_dim must be >= 1, got %r"
                         % (max_preconditioner_dim,))

    def row_dims(name, p):
        return 2 if p.dim() == 3 else 1

    def granule(name, p):
        return _C.shampoo_granule_rows(list(p.shape), row_dims(name, p), b)
    return Policy(granule, row_dims)


def is_matrix(name, p):
    """The default Muon-matrix test: 2-D or more (embeddings and heads included;
    pass your own to leave them to AdamW)."""
    return p.dim() >= 2


def muon(whole=False, matrix=is_matrix, split=None, split_dim=0):
    """Muon. whole=False: any row boundary (granule 1); a matrix cut across ranks
    is gathered to its root rank each step. whole=True: the planner keeps every
    Muon matrix on one rank (granule "whole"; a 3-D expert stack a whole expert
    per row), so the step moves nothing; padding grows instead (see rfsdp-plan).
    Ragged, a 3-D expert stack has rows of its last dim, so a boundary may cut an
    expert; whole, a row is one expert.

    split: the logical blocks Muon orthogonalises apart, as a dict {name: counts}
    or a function (name, parameter) -> counts or None. Names are those the model's
    named_parameters() gives, or those the module each fully_shard call shards
    gives (both are found, at any nesting of calls); a dict key that names no
    matrix is an error when an optimizer is built over the parameters. split_dim
    0 (default): the counts are rows of each matrix (heads of an nn.Linear's
    [out, in] weight, a fused QKV's q, k, v); 1: columns (GPT-2's Conv1D stores
    c_attn.weight as [in, 3 * in]: its heads are column blocks). The plan keeps
    every block whole (row blocks: boundaries at block edges when the blocks are
    equal, else none inside a matrix: block_granule_rows; column blocks span
    every row, so their matrix is kept whole) and carries the blocks to the
    shards, where Muon takes them as the parameter's split_sizes (and split_dim)
    when its group gives none: each rank orthogonalises its blocks where they
    lie and the step moves nothing for them."""
    if split_dim not in (0, 1) or isinstance(split_dim, bool):
        raise ValueError("policy.muon: split_dim must be 0 (rows) or 1 (columns), got %r"
                         % (split_dim,))
    table = split if isinstance(split, dict) else None

    def split_of(name, p):
        if split is None:
            return None
        s = pol._lookup(table, name) if table is not None else split(name, p)
        if s is None:
            return None
        if not matrix(name, p) or p.dim() < 2:
            raise ValueError("policy.muon: split names '%s' of shape %s, which is not a Muon "
                             "matrix (split only 2-D weights and 3-D expert stacks)"
                             % (name, tuple(p.shape)))
        return [int(x) for x in s]

    def row_dims(name, p):
        if split_of(name, p) is not None and p.dim() == 3:
            return 2
        return 2 if p.dim() == 3 and not whole and matrix(name, p) else 1

    def granule(name, p):
        s = split_of(name, p)
        if s is not None:
            return _C.block_granule_rows(name, list(p.shape), row_dims(name, p), s, split_dim)
        if not whole or not matrix(name, p):
            return 1
        return 1 if p.dim() == 3 else WHOLE
    pol = Policy(granule, row_dims, split_of if split is not None else None, blocks_dim=split_dim,
                 keys=table.keys() if table is not None else ())
    return pol


def of(optimizer):
    """The sharding policy an rfsdp optimizer's state asks for, from the optimizer's
    own settings, so a block size, a tile or a split is stated once:

        opt = rfsdp.optim.AdamW8bit(model.parameters(), block=(32, 32))
        rfsdp.fully_shard(model, policy=rfsdp.policy.of(opt))   # opt follows the shards

    Per parameter of the optimizer (its groups as they are now): AdamW8bit, its
    blocks where the tensor is large enough to be coded (min_8bit_size); Muon, the
    group's split_sizes and split_dim as logical blocks and, with 8-bit momentum,
    its momentum_block (Muon's AdamW part: any row); Shampoo and SOAP, whole tiles
    of max_preconditioner_dim where the group preconditions; AdamW: any row.
    Parameters the optimizer does not hold: any row. The optimizer must be built on
    the parameters before they are sharded (it follows them to their shards)."""
    from . import optim
    from .fsdp.unit import shard_info
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    if any(shard_info(p) is not None for g in optimizer.param_groups for p in g["params"]):
        raise ValueError("rfsdp.policy.of: the optimizer holds sharded parameters already; build "
                         "it on the model's parameters before rfsdp.fully_shard (it follows them "
                         "to their shards) and pass policy.of(opt) to fully_shard")
    settings = optimizer.config.settings() if hasattr(optimizer, "config") else {}

    def held(p, key=None):
        g = group_of.get(id(p))
        return g is not None and (key is None or g[key])

    if isinstance(optimizer, optim.AdamW8bit):
        eight = blockwise_8bit(settings["block"])
        return Policy(lambda name, p, rd: eight.granule(name, p, rd)
                      if held(p) and p.numel() >= settings["min_8bit_size"] else 1)
    if isinstance(optimizer, optim.AdamW):
        return adamw()
    if isinstance(optimizer, (optim.Shampoo, optim.SOAP)):
        key = "use_shampoo" if isinstance(optimizer, optim.Shampoo) else "use_soap"
        tiles = shampoo(settings["max_preconditioner_dim"])
        return Policy(lambda name, p: tiles.granule(name, p) if held(p, key) else 1,
                      lambda name, p: tiles.row_dims(name, p) if held(p, key) else 1)
    if isinstance(optimizer, optim.Muon):
        from .optim.muon import _split_dim, _takes_muon
        takes = [g for g in optimizer.param_groups
                 if any(_takes_muon(g, p) for p in g["params"])]
        dims = {_split_dim(g) for g in takes if g["split_sizes"] is not None}
        if len(dims) > 1:
            raise ValueError("rfsdp.policy.of: Muon's groups split along rows and columns "
                             "(split_dim 0 and 1); a plan carries blocks along one dim")

        def split(name, p):
            g = group_of.get(id(p))
            if g is None or not _takes_muon(g, p) or g["split_sizes"] is None:
                return None
            return list(g["split_sizes"])
        matrices = muon(matrix=lambda name, p: held(p) and _takes_muon(group_of[id(p)], p),
                        split=split, split_dim=dims.pop() if dims else 0)
        if settings["momentum_dtype"] != "int8":
            return matrices
        eight = blockwise_8bit(settings["momentum_block"])
        return combine(matrices, Policy(
            lambda name, p, rd: eight.granule(name, p, rd)
            if held(p) and _takes_muon(group_of[id(p)], p) else 1))
    raise ValueError("rfsdp.policy.of: %s is not an rfsdp optimizer (AdamW, AdamW8bit, Muon, "
                     "Shampoo, SOAP)" % type(optimizer).__name__)
