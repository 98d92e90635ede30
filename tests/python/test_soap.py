"""rfsdp.optim.SOAP from Python: on fully_shard's shards (2 ranks, planned with
rfsdp.policy.shampoo) it steps as one process does on the same gradients, and
its checkpoint saved on 2 ranks resumes on 1;
param groups (use_soap=False, an LR scheduler), torch's state_dict round trip
and an rfsdp.checkpoint round trip resume exactly; bad settings are errors."""
import functools
import os
import sys
import tempfile

import pytest
import torch
from torch import nn

import rfsdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from slice_training import save_on_two_resume_on_one, set_grads  # noqa: E402

STEPS = 6
B = 8  # max_preconditioner_dim


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 16)
        self.b = nn.Linear(16, 20)
        self.experts = nn.Parameter(torch.randn(2, 8, 8) * 0.3)


def grads(seed):
    """Full gradients of every parameter, every step."""
    g = torch.Generator().manual_seed(seed + 5)
    shapes = [(n, p.shape) for n, p in Net().named_parameters()]
    return [{n: torch.randn(s, generator=g) for n, s in shapes} for _ in range(STEPS)]


def soap(model, dtype=torch.float32, state=torch.float32):
    """dtype: the bases' (and, where a torch dtype, the factors'); state: m and v's."""
    mats = [p for n, p in model.named_parameters() if n != "b.bias"]
    return rfsdp.optim.SOAP([dict(params=mats),
                             dict(params=[model.b.bias], use_soap=False, lr=1e-3)],
                            lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01,
                            precondition_frequency=2, max_preconditioner_dim=B,
                            factor_dtype=dtype if isinstance(dtype, torch.dtype) else torch.float32,
                            basis_dtype=dtype, state_dtype=state)


def worker(rank, world, seed, ckpt=None, state=torch.float32):
    """STEPS steps on `world` ranks; ckpt: save after 3 (2 ranks), or load and take
    the last STEPS - 3 (1 rank). state: SOAP's state_dtype."""
    torch.manual_seed(seed)
    model = Net()
    rfsdp.fully_shard(model, policy=rfsdp.policy.shampoo(B))
    opt = soap(model, state=state)
    gs = grads(seed)
    first = 0
    if ckpt is not None and world == 1:
        rfsdp.checkpoint.load(ckpt, model, opt)
        first = 3
    for k, g in enumerate(gs[first:], start=first):
        if ckpt is not None and world == 2 and k == 3:
            rfsdp.checkpoint.save(ckpt, model, opt)
        set_grads(model, g)
        opt.step()
    return rfsdp.full_parameters(model)


def one_process(seed, state=torch.float32):
    torch.manual_seed(seed)
    model = Net()
    opt = soap(model, state=state)
    for g in grads(seed):
        set_grads(model, g)
        opt.step()
    return model


@pytest.mark.parametrize("state", [torch.float32, "int8"], ids=["fp32", "int8"])
def test_soap_on_fully_shard_steps_as_one_process_and_its_checkpoint_resumes_on_one_rank(state):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    # 2 ranks save after 3 steps; 1 finishes
    got = save_on_two_resume_on_one(functools.partial(worker, state=state), seed)
    want = one_process(seed, state)
    torch.manual_seed(seed)
    start = dict(Net().named_parameters())
    for world, full in zip((2, 1), got):
        for n, p in want.named_parameters():
            moved = (p.detach() - start[n].detach()).abs().max().item()
            assert moved > 0, n
            torch.testing.assert_close(full[n], p.detach(), rtol=0, atol=1e-4 * moved,
                                       msg=lambda m: "%s, %d rank(s) (seed %d): %s"
                                       % (n, world, seed, m))


@pytest.mark.parametrize("dtype,state", [(torch.float32, torch.float32),
                                         (torch.bfloat16, torch.float32),
                                         (torch.float32, "int8"), ("int4", "int8")],
                         ids=["fp32", "bf16", "int8", "int4-bases"])
def test_soap_state_dict_and_checkpoint_resume_exactly(dtype, state):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    torch.manual_seed(seed)
    model = Net()
    opt = soap(model, dtype, state)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    gs = grads(seed)
    with tempfile.TemporaryDirectory() as d:
        for k, g in enumerate(gs):
            if k == 3:
                saved_sd = opt.state_dict()
                torch.save(saved_sd, os.path.join(d, "opt.pt"))
                rfsdp.checkpoint.save(os.path.join(d, "ckpt"), model, opt)
                params_at_3 = {n: p.detach().clone() for n, p in model.named_parameters()}
                lrs = [grp["lr"] for grp in opt.param_groups]
            set_grads(model, g)
            opt.step()
            sched.step()
        for how in ("state_dict", "checkpoint"):
            m2 = Net()
            o2 = soap(m2, dtype, state)
            with torch.no_grad():
                for n, p in m2.named_parameters():
                    p.copy_(params_at_3[n])
            if how == "state_dict":
                o2.load_state_dict(torch.load(os.path.join(d, "opt.pt"), weights_only=True))
            else:
                rfsdp.checkpoint.load(os.path.join(d, "ckpt"), m2, o2)
            assert [grp["lr"] for grp in o2.param_groups] == lrs
            s2 = torch.optim.lr_scheduler.StepLR(o2, step_size=2, gamma=0.5, last_epoch=-1)
            s2.last_epoch = 3
            for g in gs[3:]:
                set_grads(m2, g)
                o2.step()
                s2.step()
            for (n, p), p2 in zip(model.named_parameters(), m2.parameters()):
                assert torch.equal(p, p2), (how, n, seed)
    moments = {"exp_avg", "exp_avg_sq"} if state == torch.float32 else {
        "exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax"}
    bases = {"basis_left", "basis_right"} if isinstance(dtype, torch.dtype) else {
        "basis_left_codes", "basis_left_absmax", "basis_right_codes", "basis_right_absmax"}
    assert set(opt.state[model.a.weight]) == {"step", "factor_left", "factor_right"} | moments | bases
    assert set(opt.state[model.b.bias]) == {"step", "exp_avg", "exp_avg_sq"}  # use_soap=False
    if isinstance(dtype, torch.dtype):
        for k in ("factor_left", "factor_right", "basis_left", "basis_right"):
            assert opt.state[model.a.weight][k].dtype == dtype, k
    else:  # 4-bit bases: two codes a byte, one absmax per 64 elements
        codes = opt.state[model.a.weight]["basis_left_codes"]
        assert codes.dtype == torch.uint8 and codes.numel() == 4 * 8 * 8 // 2
        assert opt.state[model.a.weight]["basis_left_absmax"].numel() == 4
    if state == "int8":
        assert opt.state[model.a.weight]["exp_avg_codes"].dtype == torch.uint8
        # one per tile row: 16 x 12 in tiles of 8 x 8 and 8 x 4
        assert opt.state[model.a.weight]["exp_avg_absmax"].numel() == 32
    else:
        assert opt.state[model.a.weight]["exp_avg"].dtype == torch.float32


def test_soap_bad_settings_are_clear_errors():
    w = nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="precondition_frequency"):
        rfsdp.optim.SOAP([w], precondition_frequency=0)
    with pytest.raises(ValueError, match="betas"):
        rfsdp.optim.SOAP([w], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="basis_dtype"):
        rfsdp.optim.SOAP([w], basis_dtype=torch.float16)
    with pytest.raises(ValueError, match="state_dtype"):
        rfsdp.optim.SOAP([w], state_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="basis_map"):
        rfsdp.optim.SOAP([w], basis_dtype="int4", basis_map="dynamic")
    opt = rfsdp.optim.SOAP([w])
    w.grad = torch.full((4, 4), float("nan"))
    with pytest.raises(RuntimeError, match="NaN"):
        opt.step()
