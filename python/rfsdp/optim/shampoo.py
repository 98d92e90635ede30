"""Shampoo over the C++ Shampoo (optimizers/shampoo)."""
import torch

from .. import _C
from .base import _OverCpp


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

    _config_class = _C.ShampooConfig

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), epsilon=1e-12, grafting_beta2=0.999,
                 grafting_epsilon=1e-8, weight_decay=0.0, max_preconditioner_dim=1024,
                 precondition_frequency=20, start_preconditioning_step=20,
                 use_bias_correction=True, factor_dtype=torch.float32, rank_deficient="shift",
                 rank_rtol=None, basis_dtype=None, basis_block=64, basis_map="linear_square",
                 bjorck_iterations=1, process_group=None, timeout_seconds=300.0,
                 rounding="nearest"):
        self.rounding = rounding  # (checked in C++ when bound)
        self.config = _C.ShampooConfig(
            max_preconditioner_dim=max_preconditioner_dim,
            precondition_frequency=precondition_frequency,
            start_preconditioning_step=start_preconditioning_step,
            use_bias_correction=bool(use_bias_correction), factor_dtype=factor_dtype,
            rank_deficient=rank_deficient, rank_rtol=rank_rtol, basis_dtype=basis_dtype,
            basis_block=basis_block, basis_map=basis_map, bjorck_iterations=bjorck_iterations)
        super().__init__(params, dict(lr=lr, betas=betas, epsilon=epsilon,
                                      grafting_beta2=grafting_beta2,
                                      grafting_epsilon=grafting_epsilon, weight_decay=weight_decay,
                                      use_shampoo=True))
        self._set_groups(process_group, timeout_seconds)
        self._bind()

    _options_class = _C.ShampooOptions

    def _group_options(self, g):
        return dict(lr=g["lr"], betas=g["betas"], epsilon=g["epsilon"],
                    grafting_beta2=g["grafting_beta2"], grafting_epsilon=g["grafting_epsilon"],
                    weight_decay=g["weight_decay"])

    def _make_impl(self, params):
        group_of = self._group_of()
        return _C.Shampoo(self._specs(params), [bool(group_of[id(p)]["use_shampoo"]) for p in params],
                          self.config, self.comm)
