"""The public API with bad arguments, table by table: each is a clear error (the
type and the words that say what was wrong), never a crash, a hang or a silent
fallback. One process (a one-rank group where fully_shard needs one)."""
import pytest
import torch
from torch import nn

import rfsdp


def p(*shape, **kw):
    return nn.Parameter(torch.zeros(*shape, **kw))


def plan(world=2, **tensor):
    t = dict(name="w", shape=[8, 4], granule_rows=1, dtype_bytes=4)
    t.update(tensor)
    return rfsdp.plan([t], world)


def step_with_grad(make, grad, reshape_to=None):
    q = p(4, 4)
    opt = make([q])
    q.grad_dtype = None  # torch refuses a .grad of another dtype unless told
    q.grad = grad
    if reshape_to is not None:  # and one of another shape when assigned: set_ changes it after
        q.grad.set_(torch.zeros(reshape_to))
    opt.step()


def lr_set_later(lr):
    q = p(4, 4)
    opt = rfsdp.optim.Shampoo([q])
    opt.param_groups[0]["lr"] = lr
    q.grad = torch.zeros(4, 4)
    opt.step()


def mixed(dtype):
    rfsdp.fully_shard(nn.Linear(4, 4), mp_policy=rfsdp.MixedPrecisionPolicy(param_dtype=dtype))


class NotFloat32(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 4, dtype=torch.float64))


CASES = [
    # optimizers: hyperparameters
    ("adamw lr < 0", lambda: rfsdp.optim.AdamW([p(4)], lr=-1e-3), ValueError, "lr >= 0"),
    ("adamw beta2 = 1", lambda: rfsdp.optim.AdamW([p(4)], betas=(0.9, 1.0)), ValueError, "betas < 1"),
    ("adamw beta1 < 0", lambda: rfsdp.optim.AdamW([p(4)], betas=(-0.1, 0.9)), ValueError, "betas"),
    ("adamw eps = 0", lambda: rfsdp.optim.AdamW([p(4)], eps=0.0), ValueError, "eps > 0"),
    ("adamw8bit block 0", lambda: rfsdp.optim.AdamW8bit([p(4, 64)], block=0), ValueError,
     "block sizes must be positive"),
    ("adamw8bit tile 3x0", lambda: rfsdp.optim.AdamW8bit([p(4, 64)], block=(3, 0)), ValueError,
     "3x0 tiles"),
    ("muon on a bias", lambda: rfsdp.optim.Muon([dict(params=[p(4)], use_muon=True)]), ValueError,
     "orthogonalises matrices"),
    ("muon ns_steps 0", lambda: rfsdp.optim.Muon([p(4, 4)], ns_steps=0), ValueError,
     "ns_steps must be a positive integer"),
    ("muon momentum 1", lambda: rfsdp.optim.Muon([p(4, 4)], momentum=1.0), ValueError,
     "0 <= momentum < 1"),
    ("muon adjust_lr", lambda: rfsdp.optim.Muon([p(4, 4)], adjust_lr="rms"), ValueError,
     'adjust_lr must be "original" or "match_rms_adamw", got "rms"'),
    ("muon ns_dtype", lambda: rfsdp.optim.Muon([p(4, 4)], ns_dtype=torch.float16), ValueError,
     "ns_dtype"),
    ("shampoo frequency 0", lambda: rfsdp.optim.Shampoo([p(4, 4)], precondition_frequency=0),
     ValueError, "precondition_frequency must be a positive integer"),
    ("shampoo start < frequency",
     lambda: rfsdp.optim.Shampoo([p(4, 4)], precondition_frequency=4, start_preconditioning_step=2),
     ValueError, "must be >= precondition_frequency"),
    ("shampoo epsilon < 0", lambda: rfsdp.optim.Shampoo([p(4, 4)], epsilon=-1.0), ValueError,
     "epsilon >= 0"),
    ("shampoo grafting eps 0", lambda: rfsdp.optim.Shampoo([p(4, 4)], grafting_epsilon=0.0),
     ValueError, "grafting_epsilon > 0"),
    ("shampoo beta1 = 1", lambda: rfsdp.optim.Shampoo([p(4, 4)], betas=(1.0, 0.9)), ValueError,
     "beta1 < 1"),
    ("shampoo dim 0", lambda: rfsdp.optim.Shampoo([p(4, 4)], max_preconditioner_dim=0), ValueError,
     "max_preconditioner_dim must be a positive integer"),
    ("shampoo fp16 factors", lambda: rfsdp.optim.Shampoo([p(4, 4)], factor_dtype=torch.float16),
     ValueError, "factor_dtype"),
    # optimizers: parameters and gradients
    ("float64 parameter", lambda: rfsdp.optim.AdamW([p(3, dtype=torch.float64)]), ValueError,
     "AdamW: parameter 'param 0' is a Double tensor; the optimizers keep float32 state and step "
     "float32, bfloat16 or float16 parameters"),
    ("meta parameter", lambda: rfsdp.optim.Shampoo([p(3, device="meta")]), ValueError,
     "Shampoo: parameter 'param 0' must be a contiguous float32, bfloat16 or float16 tensor on "
     "the CPU or a CUDA device; got Float tensor on meta"),
    ("gradient of another shape",
     lambda: step_with_grad(rfsdp.optim.AdamW, torch.zeros(4, 4), reshape_to=(3, 4)),
     ValueError, "AdamW: the gradient of parameter 'param 0' must be a contiguous float32 tensor "
     "of 16 elements on cpu (the parameter's device); got 12 Float elements"),
    ("non-contiguous gradient",
     lambda: step_with_grad(rfsdp.optim.AdamW, torch.zeros(4, 4).t().contiguous().t()),
     ValueError, "the gradient of parameter 'param 0' must be a contiguous float32 tensor"),
    ("float64 gradient for Muon",
     lambda: step_with_grad(rfsdp.optim.Muon, torch.zeros(4, 4, dtype=torch.float64)),
     ValueError, "Muon: the gradient of parameter 'param 0' must be a contiguous float32 tensor"),
    ("a bad lr from a scheduler", lambda: lr_set_later(-1.0), ValueError,
     "Shampoo: need lr >= 0"),
    ("NaN gradient", lambda: step_with_grad(rfsdp.optim.Shampoo, torch.full((4, 4), float("nan"))),
     RuntimeError, "holds NaN or Inf"),
    # planning and policies
    ("world size 0", lambda: plan(world=0), ValueError, "world"),
    ("granule 0 in a plan", lambda: plan(granule_rows=0), ValueError, "granule"),
    ("negative dim", lambda: plan(shape=[8, -4]), ValueError, "shape"),
    ("no dtype_bytes", lambda: rfsdp.plan([dict(name="w", shape=[4])], 2), ValueError,
     "needs \"dtype_bytes\""),
    ("granule 0 from a policy",
     lambda: rfsdp.policy.Policy(lambda n, q: 0).granule("w", p(4, 4)), ValueError,
     "granule must be a positive integer"),
    ("shampoo policy dim 0", lambda: rfsdp.policy.shampoo(0), ValueError,
     "max_preconditioner_dim must be >= 1"),
    # sharding
    ("clip without units", lambda: rfsdp.clip_grad_norm_(nn.Linear(2, 2), 1.0), ValueError,
     "no fully_shard units"),
    ("int32 param dtype", lambda: mixed(torch.int32), ValueError, "param_dtype"),
    ("float64 model", lambda: rfsdp.fully_shard(NotFloat32()), ValueError,
     "parameter 'w' is torch.float64; shards hold float32"),
    ("meta module", lambda: rfsdp.fully_shard(nn.Linear(4, 4, device="meta")), ValueError,
     "parameters on meta are not supported"),
    ("prefetch without units", lambda: rfsdp.set_prefetch(nn.Linear(2, 2), False), ValueError,
     "no fully_shard units"),
    # quantisation and checkpoints
    ("quantise int32", lambda: rfsdp.quant.quantize_blockwise(torch.zeros(8, dtype=torch.int32)),
     ValueError, "must be float32"),
    ("quantise on meta", lambda: rfsdp.quant.quantize_blockwise(torch.zeros(8, device="meta")),
     ValueError, "block-wise quantisation runs on tensors with values"),
    ("dequantise absmax on meta",
     lambda: rfsdp.quant.dequantize_blockwise(torch.zeros(8, dtype=torch.uint8),
                                              torch.zeros(1, device="meta")),
     ValueError, "absmax is on meta: block-wise quantisation runs on tensors with values"),
    ("keep_last 0", lambda: rfsdp.checkpoint.save_step("/nonexistent/x", 1, nn.Linear(2, 2),
                                                       keep_last=0),
     ValueError, "keep_last must be >= 1"),
    ("load a folder that is not a checkpoint",
     lambda: rfsdp.checkpoint.load("/nonexistent/x", nn.Linear(2, 2)), rfsdp.checkpoint.CheckpointError,
     "no .metadata"),
]


@pytest.mark.parametrize("what,call,error,words", CASES, ids=[c[0] for c in CASES])
def test_bad_argument_is_a_clear_error(one_rank, what, call, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        call()
