"""Flows users bring, on 2 ranks (processes, Gloo), each against one process
training on the whole batch:
- DistributedDataParallel: plain parameters on every rank (replicated); every
  optimizer takes them (Muon spreads its Newton-Schulz over the ranks and sends
  each result to the others);
- accelerate's order: the optimizer built on the plain model (replicated there),
  torch's fully_shard afterwards, param_groups switched to the sharded parameters
  by name (what accelerate's fsdp2_switch_optimizer_parameters does), after
  model.to(torch.device("cpu", 0)) (what its prepare_model does);
- bfloat16 parameters under FSDP2 stepped with stochastic rounding, from the same
  gradients: bit for bit the one-process run (the rounding noise depends on the
  element, not on the rank that rounds it).
And transformers' Trainer (torchrun, 2 ranks) with an rfsdp optimizer handed in
through optimizers=(opt, None), the model sharded by transformers' own FSDP2
loading, against the same Trainer in one process."""
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import OPTIMIZERS, Net, data, fsdp2, full_params, optimizer  # noqa: E402
from ranks import run_ranks  # noqa: E402

WORLD = 2
HERE = os.path.dirname(os.path.abspath(__file__))


def train(model, opt, seed, rank, world, emulate=1):
    """Each step on this rank's slice of the batch; emulate > 1 (one process): the
    gradient as `emulate` ranks average theirs, slice by slice (each halved exactly:
    the same sum the ranks' average makes), so runs compare bit for bit."""
    xs, ys = data(seed)
    per = xs.shape[1] // (world * emulate)
    for x, y in zip(xs, ys):
        opt.zero_grad()
        for k in range(rank * emulate, (rank + 1) * emulate):
            loss = nn.functional.mse_loss(model(x[k * per:(k + 1) * per]),
                                          y[k * per:(k + 1) * per])
            (loss / emulate).backward()
        opt.step()


def bf16_steps(model, seed, mesh=None):
    """AdamW with stochastic rounding on a bfloat16 model, 4 steps of fixed
    gradients (each rank its rows where FSDP2 sharded the parameters)."""
    opt = optimizer("AdamW", model.parameters(), rounding="stochastic")
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(4):
        for p in model.parameters():
            g = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
            if mesh is not None:
                from torch.distributed.tensor import distribute_tensor
                g = distribute_tensor(g, mesh, p.placements)
            p.grad = g
        opt.step()


def worker(rank, world, seed):
    out = {}
    for name in OPTIMIZERS:
        torch.manual_seed(seed)
        model = nn.parallel.DistributedDataParallel(Net())
        opt = optimizer(name, model.parameters())
        train(model, opt, seed, rank, world)
        out[("ddp", name)] = full_params(model.module)
    for name in OPTIMIZERS:
        torch.manual_seed(seed)
        model = Net()
        opt = optimizer(name, model.parameters(),
                        **({"max_preconditioner_dim": 1} if name == "SOAP" else {}))
        model.to(torch.device("cpu", 0))
        before = dict(model.named_parameters())
        fsdp2(model, world)
        after = dict(model.named_parameters())
        mapping = {id(p): after[n] for n, p in before.items()}
        for g in opt.param_groups:
            g["params"] = [mapping[id(p)] for p in g["params"]]
        train(model, opt, seed, rank, world)
        out[("accelerate", name)] = full_params(model)
    torch.manual_seed(seed)
    model, mesh = fsdp2(Net().to(torch.bfloat16), world)
    bf16_steps(model, seed, mesh)
    out["bf16"] = full_params(model)
    return out if rank == 0 else None


def reference(name, seed, **kw):
    torch.manual_seed(seed)
    model = Net()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (as the ranks: one BLAS thread each)
    try:
        train(model, optimizer(name, model.parameters(), **kw), seed, 0, 1, emulate=WORLD)
    finally:
        torch.set_num_threads(threads)
    return full_params(model)


def test_ddp_and_accelerates_order_train_like_one_process():
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    got = run_ranks(worker, WORLD, seed)[0]
    for name in OPTIMIZERS:
        want = reference(name, seed)
        soap1 = reference(name, seed, max_preconditioner_dim=1) if name == "SOAP" else want
        for flow, w in (("ddp", want), ("accelerate", soap1)):
            for n, t in w.items():
                g = got[(flow, name)][n]
                assert torch.equal(g, t), "seed %d, %s, %s, %s: %g apart" % (
                    seed, flow, name, n, (g - t).abs().max().item())
    torch.manual_seed(seed)
    model = Net().to(torch.bfloat16)
    start = full_params(model)
    bf16_steps(model, seed)
    for n, t in full_params(model).items():
        assert not torch.equal(t, start[n]) and torch.equal(got["bf16"][n], t), (seed, n)


# ---- transformers' Trainer ---------------------------------------------------------------

@pytest.mark.parametrize("world", [WORLD])
def test_transformers_trainer_with_an_rfsdp_optimizer_trains_like_one_process(world, tmp_path):
    script = os.path.join(HERE, "trainer_worker.py")
    model_dir = str(tmp_path / "model")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    subprocess.run([sys.executable, script, "make", model_dir], check=True, env=env)
    one = subprocess.run([sys.executable, script, "train", model_dir, str(tmp_path / "one.pt")],
                         env=env, capture_output=True, text=True)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", str(world), script, "train", model_dir,
                          str(tmp_path / "two.pt")], env=env, capture_output=True, text=True)
    assert two.returncode == 0, two.stderr[-3000:]
    want = torch.load(tmp_path / "one.pt")
    got = torch.load(tmp_path / "two.pt")
    assert set(got) == set(want)
    for name in want:
        # Two ranks sum the gradients in another order than one process: float rounding
        # apart, which SOAP's eigenbases of these tiny, near-degenerate factors amplify
        # (measured: a 1e-7 relative change of its gradients moves its losses 1e-4, and
        # flips a few elements' updates: SOAP's then held to 2 lr a step of 4).
        # (Shampoo's roots amplify it too, less: 1e-4; measured within 1e-5 on Intel Xeon)
        tol, atol = {"SOAP": (1e-3, 8e-3), "Shampoo": (1e-4, 1e-4)}.get(name, (1e-5, 1e-5))
        assert got[name]["losses"] == pytest.approx(want[name]["losses"], rel=tol), name
        moved = 0
        for n, t in want[name]["params"].items():
            torch.testing.assert_close(got[name]["params"][n], t, rtol=tol, atol=atol,
                                       msg=lambda m: "%s, %s: %s" % (name, n, m))
            moved += not torch.equal(t, want[name]["start"][n])
        assert moved == len(want[name]["params"]), (name, moved)
