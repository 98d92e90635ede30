"""Shampoo over the C++ Shampoo (optimizers/shampoo)."""
import torch

from .. import _C
from .base import _OverCpp, _shard_spec
from .requantize import _check_quantised_bases, _decode_squares, _encode_squares, _like_rows, \
    _lowbit_format, _offsets, _pieces, _side, _tiles_here


def _shampoo_options(g):
    return (g["lr"], *g["betas"], g["epsilon"], g["grafting_beta2"], g["grafting_epsilon"],
            g["weight_decay"])


class _Tiled(_OverCpp):
    """Shampoo's and SOAP's shared face: their tiles."""

    def shared_tile_rows(self):
        """Rows of tiles that shard boundaries cut (over all ranks): each goes to
        its owner and back every step; 0 means none."""
        self._bind()
        return self._impl.shared_tile_rows()


class Shampoo(_Tiled):
    """Block Shampoo with Adam grafting (DistributedShampoo's algorithm) over
    ragged shards: every matrix is cut into tiles of at most
    max_preconditioner_dim rows and columns (a 3-D [E, H, I] stack: E matrices
    H x I), each tile's factors L, R and inverse fourth roots live on the rank
    that holds the tile (plan with rfsdp.policy.shampoo(max_preconditioner_dim)),
    so the sharded step is the single-device step and nothing is communicated but
    the NaN/Inf flag. Where shard boundaries cut a row of tiles (torch FSDP2's
    chunk rows), the rank holding its first row owns it: the others send it their
    rows (gradient; M^ and D) and get their update rows back, three all-to-alls a
    step for all such rows (ATen copies: the same path on a CPU and a GPU). 1-D
    parameters and groups with use_shampoo=False take the grafted direction alone (AdamW with grafting_beta2 and grafting_epsilon).

    Per step t of a parameter: V <- b2g V + (1 - b2g) g^2; M <- b1 M + (1 - b1) g;
    D = M^ / (sqrt(V^) + grafting_epsilon) (Adam's, bias-corrected); per tile
    L <- b2 L + (1 - b2) G G^T, R <- b2 R + (1 - b2) G^T G; every
    precondition_frequency steps the roots of L / (1 - b2^t) + epsilon I (and R's),
    by eigendecomposition in fp32, retried in fp64; from start_preconditioning_step
    on, P = L^-1/4 M^ R^-1/4 scaled to |D| per tile, else D; X <- X (1 - lr wd) - lr P.
    factor_dtype=torch.bfloat16 stores L, R and the roots in bf16 (computed in fp32).

    Rank-deficient factors (rare tokens' rows, zero rows, low-rank gradients) are
    normal: rounding then puts their smallest eigenvalues below epsilon, or below
    zero (about -1e-8 of the largest in fp32, -2^-9 in bf16). rank_deficient says
    what the root does with them: "shift" (default; DistributedShampoo's
    perturbation) lifts the spectrum so its smallest eigenvalue is epsilon (needs
    epsilon > 0); "pseudo_inverse" treats eigenvalues <= rank_rtol * the largest as
    zero, leaving their directions unpreconditioned (rank_rtol None: n * eps(float32)
    for an n x n factor); "strict" fails on any eigenvalue <= 0 (retried in fp64;
    three failures in a row on one tile are an error). Roots that do not converge
    or are not finite fail in every mode. Any failure, on any rank, stops the step
    on every rank before anything changes.

    basis_dtype="int8" or "int4" keeps each root A^-1/4 = Q diag(s) Q^T as its
    eigenvectors Q in block-wise codes (blocks of basis_block elements of the
    n x n matrix, one fp32 absmax each; map basis_map: "linear_square" as 4-bit
    Shampoo's, "linear", or "dynamic" at 8 bits; 4-bit codes two to a byte) and s
    in fp32; a step that preconditions rebuilds the root from Q dequantised and
    rectified by bjorck_iterations Björck steps. None: packed roots in
    factor_dtype.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), epsilon=1e-12, grafting_beta2=0.999,
                 grafting_epsilon=1e-8, weight_decay=0.0, max_preconditioner_dim=1024,
                 precondition_frequency=20, start_preconditioning_step=20,
                 use_bias_correction=True, factor_dtype=torch.float32, rank_deficient="shift",
                 rank_rtol=None, basis_dtype=None, basis_block=64, basis_map="linear_square",
                 bjorck_iterations=1, process_group=None, timeout_seconds=300.0,
                 rounding="nearest"):
        self.rounding = rounding  # (checked in C++ when bound)
        for name, v in (("max_preconditioner_dim", max_preconditioner_dim),
                        ("precondition_frequency", precondition_frequency),
                        ("start_preconditioning_step", start_preconditioning_step)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError("Shampoo: %s must be a positive integer, got %r" % (name, v))
        if factor_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("Shampoo: factor_dtype must be torch.float32 or torch.bfloat16")
        if rank_rtol is not None and not (0 <= rank_rtol < 1):
            raise ValueError("Shampoo: rank_rtol must be in [0, 1) (None: n * eps(float32) for an "
                             "n x n factor), got %r" % (rank_rtol,))
        if basis_dtype not in (None, "int8", "int4"):
            raise ValueError("Shampoo: basis_dtype must be None (roots in factor_dtype), \"int8\" "
                             "or \"int4\", got %r" % (basis_dtype,))
        _check_quantised_bases("Shampoo", basis_dtype, basis_map, basis_block, bjorck_iterations)
        self.config = dict(max_preconditioner_dim=max_preconditioner_dim,
                           precondition_frequency=precondition_frequency,
                           start_preconditioning_step=start_preconditioning_step,
                           use_bias_correction=bool(use_bias_correction),
                           factor_dtype=str(factor_dtype).replace("torch.", ""),
                           rank_deficient=rank_deficient,
                           rank_rtol=-1.0 if rank_rtol is None else float(rank_rtol),
                           basis_dtype=basis_dtype, basis_block=basis_block, basis_map=basis_map,
                           bjorck_iterations=bjorck_iterations)
        super().__init__(params, dict(lr=lr, betas=betas, epsilon=epsilon,
                                      grafting_beta2=grafting_beta2,
                                      grafting_epsilon=grafting_epsilon, weight_decay=weight_decay,
                                      use_shampoo=True))
        self._set_groups(process_group, timeout_seconds)
        self._bind()

    def settings(self):
        cfg = dict(self.config)
        if cfg["basis_dtype"] is None:  # packed roots: the settings they had before basis_dtype
            for k in ("basis_dtype", "basis_block", "basis_map", "bjorck_iterations"):
                del cfg[k]
        return dict(super().settings(), **cfg)

    def requantized_state(self, p, saved_settings, full):
        """p's state under this optimizer's root storage from a checkpoint's full
        (unsharded) state of p, saved by a Shampoo with saved_settings (another
        basis_dtype, basis_block, basis_map or bjorck_iterations): each root of this
        rank's tiles as the saved optimizer used it (Q dequantised and rectified,
        with its s; or the packed root, whose eigh gives Q and s), then stored as
        this one keeps it; every other state this rank's piece as saved. For
        load_sharded_state."""
        self._bind_for(p)
        live = self.sharded_state(p)
        out = _like_rows(p, full, live, ("exp_avg", "exp_avg_sq"))
        if "step" in full:
            out["step"] = full["step"]
        if "factor_left" not in live:  # grafting alone
            return out
        tiles, a, b = _tiles_here(p, self.config["max_preconditioner_dim"])
        packed = {True: lambda t: t[1] * (t[1] + 1) // 2, False: lambda t: t[2] * (t[2] + 1) // 2}
        out.update(_pieces(full, live, tiles, a, b, {"factor_left": packed[True],
                                                     "factor_right": packed[False],
                                                     "root_failures": lambda t: 1}))
        old = _lowbit_format(saved_settings.get("basis_dtype"), saved_settings.get("basis_block"),
                             saved_settings.get("basis_map"))
        new = _lowbit_format(self.config["basis_dtype"], self.config["basis_block"],
                             self.config["basis_map"])
        fdt = getattr(torch, self.config["factor_dtype"])
        for left, side in ((True, "root_left"), (False, "root_right")):
            if old is None:  # packed roots R = Q diag(s) Q^T: their eigh
                off = _offsets(tiles, packed[left])
                eig = [torch.linalg.eigh(_C.shampoo_unpack(full[side].reshape(-1), off[k],
                                                           _side(tiles[k], left)).double())
                       for k in range(a, b)]
                qs, ss = [q.float() for _, q in eig], [lam.float() for lam, _ in eig]
            else:
                qs = _decode_squares(full, side + "_basis", tiles, left, old,
                                     saved_settings["bjorck_iterations"], a, b)
                so = _offsets(tiles, lambda t: _side(t, left))
                ss = [full[side + "_eigenvalues"].reshape(-1)[so[k]:so[k + 1]].float()
                      for k in range(a, b)]
            if new is None:
                roots = [_C.shampoo_pack((q.double() * s.double()) @ q.double().T) for q, s in zip(qs, ss)]
                out[side] = torch.cat(roots).to(fdt) if roots else torch.zeros(0, dtype=fdt)
            else:
                out.update(_encode_squares(qs, side + "_basis", new, torch.float32))
                out[side + "_eigenvalues"] = torch.cat(ss) if ss else torch.zeros(0)
        return out

    def _parts(self, params):
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        self._impl = _C.Shampoo([_shard_spec(i, p) for i, p in enumerate(params)],
                                [bool(group_of[id(p)]["use_shampoo"]) for p in params],
                                self.config["max_preconditioner_dim"],
                                self.config["precondition_frequency"],
                                self.config["start_preconditioning_step"],
                                self.config["use_bias_correction"], self.config["factor_dtype"],
                                self.comm, self.config["rank_deficient"],
                                self.config["rank_rtol"], self.config["basis_dtype"] or "",
                                self.config["basis_block"], self.config["basis_map"],
                                self.config["bjorck_iterations"])
        return [(self._impl, list(range(len(params))), _shampoo_options)]


# ---- checkpoints into other basis storage (Shampoo's roots, SOAP's bases) ----------------
# A saved state of a tiled optimizer is, per parameter, a global sequence of per-tile
# entries in tile order (each rank's tiles: those whose first element it holds).
