"""The public API with bad arguments, table by table: each is a clear error (the
type and the words that say what was wrong), never a crash, a hang or a silent
fallback. One process (a one-rank group where fully_shard needs one)."""
import re

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
    ("adamw lr < 0", lambda: rfsdp.optim.AdamW([p(4)], lr=-1e-3), ValueError,
     "AdamW: lr must be >= 0, got -0.001"),
    ("adamw beta2 = 1", lambda: rfsdp.optim.AdamW([p(4)], betas=(0.9, 1.0)), ValueError,
     "AdamW: betas[1] must be in [0, 1), got 1"),
    ("adamw beta1 < 0", lambda: rfsdp.optim.AdamW([p(4)], betas=(-0.1, 0.9)), ValueError,
     "AdamW: betas[0] must be in [0, 1), got -0.1"),
    ("adamw eps = 0", lambda: rfsdp.optim.AdamW([p(4)], eps=0.0), ValueError,
     "AdamW: eps must be > 0, got 0"),
    # small values print as they are (std::to_string gave eps=0.000000)
    ("adamw eps < 0", lambda: rfsdp.optim.AdamW([p(4)], eps=-1e-8), ValueError,
     "AdamW: eps must be > 0, got -1e-08"),
    ("adamw betas of one", lambda: rfsdp.optim.AdamW([p(4)], betas=(0.9,)), ValueError,
     "AdamW: betas must be a pair (beta1, beta2), got (0.9,)"),
    ("soap betas of three", lambda: rfsdp.optim.SOAP([p(4, 4)], betas=(0.9, 0.9, 0.9)), ValueError,
     "SOAP: betas must be a pair (beta1, beta2), got (0.9, 0.9, 0.9)"),
    ("muon adamw part betas", lambda: rfsdp.optim.Muon([dict(params=[p(4)], use_muon=False,
                                                             betas="ab")]), ValueError,
     "Muon: betas must be a pair (beta1, beta2), got 'ab'"),
    ("adamw8bit block 0", lambda: rfsdp.optim.AdamW8bit([p(4, 64)], block=0), ValueError,
     "block sizes must be positive"),
    ("adamw8bit tile 3x0", lambda: rfsdp.optim.AdamW8bit([p(4, 64)], block=(3, 0)), ValueError,
     "3x0 tiles"),
    ("muon on a bias", lambda: rfsdp.optim.Muon([dict(params=[p(4)], use_muon=True)]), ValueError,
     "orthogonalises matrices"),
    ("muon ns_steps 0", lambda: rfsdp.optim.Muon([p(4, 4)], ns_steps=0), ValueError,
     "ns_steps must be a positive integer"),
    ("muon momentum 1", lambda: rfsdp.optim.Muon([p(4, 4)], momentum=1.0), ValueError,
     "Muon: momentum must be in [0, 1), got 1"),
    ("muon adamw part eps", lambda: rfsdp.optim.Muon([dict(params=[p(4)], use_muon=False,
                                                           eps=0.0)]), ValueError,
     "Muon: the AdamW part (use_muon=False groups): eps must be > 0, got 0"),
    ("muon hyperball None", lambda: rfsdp.optim.Muon([p(4, 4)], hyperball=None, weight_decay=0.0),
     ValueError, "group option 'hyperball' must be True or False, got None"),
    ("adamw hyperball string", lambda: rfsdp.optim.AdamW([p(4, 4)], hyperball="yes",
                                                         weight_decay=0.0),
     ValueError, "group option 'hyperball' must be True or False, got 'yes'"),
    ("muon nesterov None", lambda: rfsdp.optim.Muon([p(4, 4)], nesterov=None), ValueError,
     "group option 'nesterov' must be True or False, got None"),
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
     "Shampoo: epsilon must be >= 0, got -1"),
    ("shampoo grafting eps 0", lambda: rfsdp.optim.Shampoo([p(4, 4)], grafting_epsilon=0.0),
     ValueError, "Shampoo: grafting_epsilon must be > 0, got 0"),
    ("shampoo beta1 = 1", lambda: rfsdp.optim.Shampoo([p(4, 4)], betas=(1.0, 0.9)), ValueError,
     "Shampoo: betas[0] must be in [0, 1), got 1"),
    # the value that failed, named (the check listed every condition)
    ("shampoo beta2 > 1", lambda: rfsdp.optim.Shampoo([p(4, 4)], betas=(0.9, 1.5)), ValueError,
     "Shampoo: betas[1] must be in [0, 1], got 1.5"),
    ("shampoo grafting_beta2 = 1", lambda: rfsdp.optim.Shampoo([p(4, 4)], grafting_beta2=1.0),
     ValueError, "Shampoo: grafting_beta2 must be in [0, 1), got 1"),
    ("soap shampoo_beta = 1", lambda: rfsdp.optim.SOAP([p(4, 4)], shampoo_beta=1.0), ValueError,
     "SOAP: shampoo_beta must be in [0, 1) (negative: betas[1]), got 1"),
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
    ("sparse gradient",
     lambda: step_with_grad(rfsdp.optim.AdamW, torch.zeros(4, 4).to_sparse()), ValueError,
     "AdamW: the gradient of parameter 'param 0' is a Sparse tensor: sparse gradients are not "
     "supported"),
    ("sparse gradient for Shampoo",
     lambda: step_with_grad(rfsdp.optim.Shampoo, torch.eye(4).to_sparse()), ValueError,
     "sparse gradients are not supported"),
    ("a parameter with 0 elements in its rows",
     lambda: rfsdp.optim.Shampoo([p(4, 4), p(4, 0)]), ValueError,
     "Shampoo: parameter 'param 1' has 0 elements (shape [4, 0]): the optimizers keep state by "
     "rows, and its rows are empty; leave it out of the optimizer"),
    ("float64 gradient for Muon",
     lambda: step_with_grad(rfsdp.optim.Muon, torch.zeros(4, 4, dtype=torch.float64)),
     ValueError, "Muon: the gradient of parameter 'param 0' must be a contiguous float32 tensor"),
    ("a bad lr from a scheduler", lambda: lr_set_later(-1.0), ValueError,
     "Shampoo: lr must be >= 0, got -1"),
    ("an inf lr from a scheduler", lambda: lr_set_later(float("inf")), ValueError,
     "Shampoo: lr must be finite and >= 0, got inf"),
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
     "checkpoint /nonexistent/x: no rfsdp.json, so its files cannot be checked"),
    ("load an unchecked folder that is not a checkpoint",
     lambda: rfsdp.checkpoint.load("/nonexistent/x", nn.Linear(2, 2), check_files=False),
     rfsdp.checkpoint.CheckpointError, "no .metadata"),
]


OPTIMIZERS = [rfsdp.optim.AdamW, rfsdp.optim.AdamW8bit, rfsdp.optim.Muon, rfsdp.optim.Shampoo,
              rfsdp.optim.SOAP]


@pytest.mark.parametrize("make", OPTIMIZERS, ids=[o.__name__ for o in OPTIMIZERS])
@pytest.mark.parametrize("key,value,words", [
    ("lr", float("inf"), "lr must be finite and >= 0, got inf"),
    ("lr", float("nan"), "lr must be finite and >= 0, got nan"),
    ("weight_decay", float("inf"), "weight_decay must be finite and >= 0, got inf"),
    ("weight_decay", float("nan"), "weight_decay must be finite and >= 0, got nan")])
def test_non_finite_hyperparameters_are_refused(one_rank, make, key, value, words):
    """lr or weight_decay of inf passed `lr >= 0` and turned the parameters to inf."""
    with pytest.raises(ValueError, match=re.escape("%s: %s" % (make.__name__, words))):
        make([p(4, 4)], **{key: value})


@pytest.mark.parametrize("make", OPTIMIZERS, ids=[o.__name__ for o in OPTIMIZERS])
def test_parameters_of_0_rows_step_as_nothing(one_rank, make):
    """A 0-element parameter of 0 rows ((0, 4), (0,): torch.optim takes them) steps
    beside the others, which step as they do without it."""
    def run(with_empty):
        w = nn.Parameter(torch.linspace(-1, 1, 16).reshape(4, 4))
        b = nn.Parameter(torch.linspace(0, 1, 4))
        empty = [p(0, 4), p(0)] if with_empty else []
        opt = make([w, b] + empty)
        for s in range(3):
            for q in [w, b] + empty:
                q.grad = torch.cos(torch.arange(q.numel()) + s).reshape(q.shape)
            opt.step()
        return w.detach(), b.detach()
    for got, want in zip(run(True), run(False)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("what,call,error,words", CASES, ids=[c[0] for c in CASES])
def test_bad_argument_is_a_clear_error(one_rank, what, call, error, words):
    with pytest.raises(error, match=re.escape(words)):
        call()
