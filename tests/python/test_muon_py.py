"""rfsdp.optim.Muon against a float64 single-device Muon written in the test
(muon_reference.py): one process on plain tensors, and 2 ranks under torchrun on
a fully sharded model (ragged shards, and the whole-matrix policy)."""
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from torch import nn

import rfsdp
import muon_reference
from muon_reference import ReferenceMuon

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import muon_torchrun_worker as worker  # noqa: E402

SHAPES = {"tall": (19, 7), "wide": (5, 23), "experts": (3, 6, 4), "conv": (4, 3, 2, 2), "bias": (9,)}


def test_single_process_matches_reference_with_scheduler():
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    g = torch.Generator().manual_seed(seed)
    init = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    params = {n: nn.Parameter(t.clone()) for n, t in init.items()}
    muon_names = ["tall", "wide", "experts", "conv"]
    opt = rfsdp.optim.Muon([dict(params=[params[n] for n in muon_names]),
                            dict(params=[params["bias"]], use_muon=False, lr=1e-2, weight_decay=0.1)],
                           lr=0.03, momentum=0.9, weight_decay=0.05, adjust_lr="match_rms_adamw")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ref = ReferenceMuon({n: t.double().clone() for n, t in init.items()}, muon_names, lr=0.03,
                        momentum=0.9, weight_decay=0.05, adjust_lr="match_rms_adamw", aux_lr=1e-2,
                        aux_wd=0.1)
    for step in range(20):
        grads = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
        for n, p in params.items():
            p.grad = grads[n].clone()
        opt.step()
        ref.step(grads, lr_scale=1.0 / (1 + step))
        sched.step()
    for n, p in params.items():
        torch.testing.assert_close(p.detach().double(), ref.p[n], rtol=1e-5, atol=1e-5,
                                   msg=lambda m: "%s (seed %d): %s" % (n, seed, m))


def test_state_dict_round_trip():
    w = nn.Parameter(torch.randn(6, 4))
    b = nn.Parameter(torch.randn(4))
    opt = rfsdp.optim.Muon([dict(params=[w]), dict(params=[b], use_muon=False)])
    for _ in range(3):
        w.grad, b.grad = torch.randn(6, 4), torch.randn(4)
        opt.step()
    sd = opt.state_dict()
    w2, b2 = nn.Parameter(w.detach().clone()), nn.Parameter(b.detach().clone())
    opt2 = rfsdp.optim.Muon([dict(params=[w2]), dict(params=[b2], use_muon=False)])
    opt2.load_state_dict(sd)
    g1, g2 = torch.randn(6, 4), torch.randn(4)
    w.grad, b.grad, w2.grad, b2.grad = g1, g2, g1.clone(), g2.clone()
    opt.step()
    opt2.step()
    assert torch.equal(w, w2) and torch.equal(b, b2)
    assert torch.equal(opt.state[w]["momentum_buffer"], opt2.state[w2]["momentum_buffer"])


def test_errors():
    with pytest.raises(ValueError, match="'param 1'.*AdamW"):
        rfsdp.optim.Muon([nn.Parameter(torch.zeros(3, 3)), nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match="adjust_lr"):
        rfsdp.optim.Muon([nn.Parameter(torch.zeros(3, 3))], adjust_lr="rms")
    with pytest.raises(ValueError, match="ns_steps"):
        rfsdp.optim.Muon([nn.Parameter(torch.zeros(3, 3))], ns_steps=0)
    w = nn.Parameter(torch.ones(3, 3))
    opt = rfsdp.optim.Muon([w])
    w.grad = torch.full((3, 3), float("nan"))
    with pytest.raises(RuntimeError, match="NaN"):
        opt.step()
    assert torch.equal(w.detach(), torch.ones(3, 3)) and not opt.state[w]


def reference_training(seed):
    torch.manual_seed(seed)
    model = worker.Net()
    muon_names = [n for n, p in model.named_parameters() if worker.is_muon(n, p)]
    xs, ys = worker.data(seed)
    return muon_reference.train(model, muon_names, xs, ys, lr=0.02, weight_decay=0.01,
                                aux_lr=3e-3)


@pytest.mark.parametrize("whole", [False, True])
def test_two_ranks_torchrun_match_reference(whole):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.pt")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               "2", os.path.join(HERE, "muon_torchrun_worker.py"), "--seed", str(seed),
               "--out", out] + (["--whole"] if whole else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        got = torch.load(out)
    ref_losses, ref_params = reference_training(seed)
    assert got["losses"] == pytest.approx(ref_losses, rel=1e-4, abs=1e-6), "seed %d" % seed
    for n, want in ref_params.items():
        torch.testing.assert_close(got["params"][n].double(), want, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: "%s (seed %d): %s" % (n, seed, m))
    if whole:  # every Muon matrix on one rank: the step moves nothing
        assert got["moved"] == 0
    else:
        assert got["moved"] > 0
