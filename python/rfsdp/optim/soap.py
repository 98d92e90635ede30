"""SOAP over the C++ SOAP (optimizers/soap)."""
import torch

from .. import _C
from .shampoo import _Tiled


class SOAP(_Tiled):
    """SOAP (Vyas et al. 2024): Adam in the eigenbasis of Shampoo's factors, over
    ragged shards. Tiles are Shampoo's (at most max_preconditioner_dim rows and
    columns; a 3-D [E, H, I] stack: E matrices H x I), each whole on the rank
    that holds it (plan with rfsdp.policy.shampoo(max_preconditioner_dim)), so the
    sharded step is the single-device step. 1-D parameters and groups with
    use_soap=False take Adam with the same betas, eps, bias correction, weight
    decay and first-step skip.

    Per step t of a parameter (s = t - 1 updates so far): at t = 1 only the
    factors L, R and their eigenbases Q_L, Q_R (eigh, descending); from t = 2:
    G' = Q_L^T G Q_R, m <- b1 m + (1 - b1) G, v <- b2 v + (1 - b2) G'^2,
    N = Q_L ((Q_L^T m Q_R) / (sqrt(v) + eps)) Q_R^T,
    p <- (p - lr sqrt(1 - b2^s) / (1 - b1^s) N) (1 - lr weight_decay) (lr alone
    without correct_bias); then L, R <- shampoo_beta (default: betas[1]) decay
    plus G G^T, G^T G; every precondition_frequency updates the bases are
    refreshed by one power step and QR (columns reordered by their estimated
    eigenvalues, v permuted with them), batched by tile size. m and v are fp32;
    factor_dtype and basis_dtype (torch.float32 or torch.bfloat16) store L, R and
    Q_L, Q_R (every step computes in fp32; bf16 bases are orthogonal to about
    1e-2, not rectified). States live with the parameters, on the CPU or a GPU.
    A row of tiles that shard boundaries cut (torch FSDP2's chunk rows) goes to
    the rank holding its first row and back, as Shampoo's (shared_tile_rows()
    counts them). state_dtype="int8" keeps m and v of preconditioned parameters as 8-bit codes
    (dynamic maps, signed for m and unsigned for v), one block per tile row, so
    v's refresh permutation moves whole blocks with their scales; each step
    decodes, updates in fp32 and encodes (on any device: the CPU kernels, elsewhere the
    device-generic path, the same bits; a cut row of tiles is coded by its owner,
    which keeps its scales; 1-D parameters and use_soap=False groups keep fp32 moments);
    state_format="float8_e4m3fn" codes them as e4m3 values of each block's absmax / 448
    (decoded by arithmetic, as AdamW8bit's), None the dynamic maps. basis_dtype="int8" or "int4" stores
    Q_L, Q_R as block-wise codes (blocks of basis_block elements of a tile's
    basis, one fp32 absmax each, the map basis_map: "linear_square" as 4-bit
    Shampoo's, "linear", or "dynamic" at 8 bits; 4-bit codes two to a byte),
    dequantised and rectified by bjorck_iterations Björck steps wherever used.
    """

    _config_class = _C.SOAPConfig

    def __init__(self, params, lr=3e-3, betas=(0.95, 0.95), shampoo_beta=-1.0, eps=1e-8,
                 weight_decay=0.01, precondition_frequency=10, max_preconditioner_dim=1024,
                 correct_bias=True, factor_dtype=torch.float32, basis_dtype=torch.float32,
                 state_dtype=torch.float32, basis_block=64, basis_map="linear_square",
                 bjorck_iterations=1, process_group=None, timeout_seconds=300.0,
                 rounding="nearest", state_format=None):
        self.rounding = rounding  # (checked in C++ when bound)
        self.config = _C.SOAPConfig(
            max_preconditioner_dim=max_preconditioner_dim,
            precondition_frequency=precondition_frequency, correct_bias=bool(correct_bias),
            factor_dtype=factor_dtype, basis_dtype=basis_dtype, state_dtype=state_dtype,
            basis_block=basis_block, basis_map=basis_map, bjorck_iterations=bjorck_iterations,
            state_format=state_format)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), shampoo_beta=shampoo_beta,
                                      eps=eps, weight_decay=weight_decay, use_soap=True))
        self._set_groups(process_group, timeout_seconds)
        self._bind()

    _options_class = _C.SOAPOptions

    def _group_options(self, g):
        return dict(lr=g["lr"], betas=g["betas"], shampoo_beta=g["shampoo_beta"], eps=g["eps"],
                    weight_decay=g["weight_decay"])

    def _make_impl(self, params):
        group_of = self._group_of()
        return _C.SOAP(self._specs(params), [bool(group_of[id(p)]["use_soap"]) for p in params],
                       self.config, self.comm)

