"""An rfsdp optimizer's state_dict() is sharded or full as set_state_dict_type
says, and, unset, what torch's get_optimizer_state_dict asks (full_state_dict=True:
full tensors, as for a model): both routes give the same full tensors, of the
global shapes, whose rows on each rank are that rank's state."""
import os
import sys

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

import rfsdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import Net, data  # noqa: E402
from ranks import run_ranks  # noqa: E402


def _worker(rank, world):
    torch.manual_seed(0)
    model = Net()
    shapes = {n: p.shape for n, p in model.named_parameters()}
    for b in model.blocks:
        rfsdp.fully_shard(b)
    rfsdp.fully_shard(model)
    opt = rfsdp.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in zip(*data(2)):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    sharded = opt.state_dict()["state"]
    via_torch = get_optimizer_state_dict(model, opt, options=StateDictOptions(
        full_state_dict=True))["state"]
    rfsdp.set_state_dict_type(opt, "full", rank0_only=False, cpu_offload=False)
    explicit = opt.state_dict()["state"]
    rfsdp.set_state_dict_type(opt, "sharded")
    names = [n for n, _ in model.named_parameters()]
    out = []
    for k, p in enumerate(model.parameters()):
        info = rfsdp.shard_info(p)
        local = opt.state[p]["exp_avg"]
        full_t, full_e = via_torch[names[k]]["exp_avg"], explicit[k]["exp_avg"]
        rows = full_e.reshape(info.global_shape[0], -1)[info.row_begin:info.row_end] \
            if len(info.global_shape) else full_e
        out.append((type(sharded[k]["exp_avg"]).__name__, type(full_t) is torch.Tensor,
                    type(full_e) is torch.Tensor, tuple(full_e.shape) == tuple(shapes[names[k]]),
                    torch.equal(full_t, full_e), torch.equal(rows.reshape(local.shape), local)))
    return out


def test_optimizer_state_dict_full_by_setting_or_by_torch():
    for r in run_ranks(_worker, 2, timeout=300):
        for kind, t_plain, e_plain, shape_ok, same, rows_ok in r:
            assert kind != "Tensor"  # sharded by default: this rank's pieces
            assert t_plain and e_plain and shape_ok and same and rows_ok
