"""rfsdp.optim.Muon against a float64 single-device Muon written in the test
(muon_reference.py): one process on plain tensors, and 2 ranks under torchrun on
a fully sharded model (ragged shards, and the whole-matrix policy)."""
import os
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
from models import ExpertNet, expert_data, is_expert_muon  # noqa: E402
from ranks import torchrun  # noqa: E402

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
    with pytest.raises(ValueError, match="'param 1'.*AdamW"):  # (a group that says use_muon)
        rfsdp.optim.Muon([dict(params=[nn.Parameter(torch.zeros(3, 3)), nn.Parameter(torch.zeros(3))],
                               use_muon=True)])
    with pytest.raises(ValueError, match="adjust_lr"):
        rfsdp.optim.Muon([nn.Parameter(torch.zeros(3, 3))], adjust_lr="rms")
    with pytest.raises(ValueError, match="ns_steps"):
        rfsdp.optim.Muon([nn.Parameter(torch.zeros(3, 3))], ns_steps=0)
    w = nn.Parameter(torch.ones(3, 3))
    opt = rfsdp.optim.Muon([w])
    w.grad = torch.full((3, 3), float("nan"))
    with pytest.raises(RuntimeError, match="gradient of parameter .* holds NaN"):
        opt.step()
    assert torch.equal(w.detach(), torch.ones(3, 3)) and not opt.state[w]


def test_gradient_checked_in_its_update_names_the_cause():
    # Muon checks a gradient through the update it makes of it: a NaN in one matrix
    # of a split parameter, or a momentum that overflows with a finite gradient, is
    # refused by its cause, and nothing changes (momentum, weights, the other matrix).
    w = nn.Parameter(torch.randn(6, 4))
    opt = rfsdp.optim.Muon([dict(params=[w], split_sizes=[2, 4])])
    w.grad = torch.randn(6, 4)
    opt.step()
    before, m = w.detach().clone(), opt.state[w]["momentum_buffer"].clone()
    g = torch.randn(6, 4)
    g[4, 1] = float("inf")
    w.grad = g
    with pytest.raises(RuntimeError, match="gradient of parameter .* holds NaN or Inf"):
        opt.step()
    assert torch.equal(w.detach(), before) and torch.equal(opt.state[w]["momentum_buffer"], m)
    opt.state[w]["momentum_buffer"].fill_(-3e38)
    w.grad = torch.full((6, 4), 3e38)
    with pytest.raises(RuntimeError, match="momentum of parameter .* overflowed"):
        opt.step()
    assert torch.equal(w.detach(), before)
    assert torch.equal(opt.state[w]["momentum_buffer"], torch.full((6, 4), -3e38))


def reference_training(seed):
    torch.manual_seed(seed)
    model = ExpertNet()
    muon_names = [n for n, p in model.named_parameters() if is_expert_muon(n, p)]
    xs, ys = expert_data(seed)
    return muon_reference.train(model, muon_names, xs, ys, lr=0.02, weight_decay=0.01,
                                aux_lr=3e-3)


@pytest.mark.parametrize("whole", [False, True])
def test_two_ranks_torchrun_match_reference(whole):
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.pt")
        torchrun(os.path.join(HERE, "muon_torchrun_worker.py"),
                 ["--seed", seed, "--out", out] + (["--whole"] if whole else []), timeout=300)
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


# Polar Express (Amsel et al., arXiv 2505.16932): the per-iteration coefficients
# its authors' code gives for 5 iterations, safety factor 2e-2, cushion 2.
POLAR_EXPRESS = [(8.156554524902461, -22.48329292557795, 15.878769915207462),
                 (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                 (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                 (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                 (2.3465413258596377, -1.7097828382687081, 0.42323551169305323)]


def float64_iteration(g, coefficients, steps, norm_scale=1.0, eps=1e-7):
    """X <- a_k X + (b_k A + c_k A^2) X, A = X X^T, from X / (norm_scale |X|_F + eps)."""
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (x.norm() * norm_scale + eps)
    for k in range(steps):
        a, b, c = coefficients[k] if len(coefficients) > 1 else coefficients[0]
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def test_ns_coefficients_polar_express_and_torch_form_equal_their_float64_iteration():
    g = torch.randn(24, 40)
    cases = [("polar_express", POLAR_EXPRESS, 5, 1.02, 1e-6),
             ((3.4445, -4.775, 2.0315), [(3.4445, -4.775, 2.0315)], 5, 1.0, 1e-7),
             ([(3.0, -3.2, 1.2), (2.0, -1.5, 0.5)], [(3.0, -3.2, 1.2), (2.0, -1.5, 0.5)], 2, 1.0, 1e-7)]
    for given, coeffs, steps, scale, eps in cases:
        for m in (g, g.T.contiguous()):
            want = float64_iteration(m, coeffs, steps, scale, eps)
            got = rfsdp._C.newton_schulz(m, steps, "float32", given)
            torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5, msg=str(given))
    # (the test can fail: Polar Express is not the quintic)
    assert (float64_iteration(g, POLAR_EXPRESS, 5, 1.02, 1e-6)
            - float64_iteration(g, [(3.4445, -4.775, 2.0315)], 5)).abs().max() > 1e-2
    # In a step: p <- p - lr * max(1, rows/cols)^0.5 * NS(momentum update)
    w = nn.Parameter(torch.randn(40, 24))
    w0, grad = w.detach().clone(), torch.randn(40, 24)
    opt = rfsdp.optim.Muon([w], lr=0.1, momentum=0.9, nesterov=False, ns_coefficients="polar_express")
    w.grad = grad
    opt.step()
    want = w0.double() - 0.1 * (40 / 24) ** 0.5 * float64_iteration(0.1 * grad, POLAR_EXPRESS, 5, 1.02, 1e-6)
    torch.testing.assert_close(w.detach().double(), want, rtol=0, atol=2e-6)
    assert opt.settings()["ns_coefficients"] == "polar_express"
    assert "ns_coefficients" not in rfsdp.optim.Muon([w]).settings()  # (as saved before it existed)


def test_ns_coefficients_and_adjust_lr_fn_errors():
    w = nn.Parameter(torch.randn(8, 8))
    with pytest.raises(ValueError, match="ns_steps=6 but ns_coefficients has 5"):
        rfsdp.optim.Muon([w], ns_coefficients="polar_express", ns_steps=6)
    with pytest.raises(ValueError, match="ns_coefficients must be"):
        rfsdp.optim.Muon([w], ns_coefficients="cubic")
    with pytest.raises(ValueError, match="adjust_lr='original'.*disagree|disagree"):
        rfsdp.optim.Muon([w], adjust_lr="match_rms_adamw", adjust_lr_fn="original")
    opt = rfsdp.optim.Muon([w], adjust_lr_fn="match_rms_adamw")
    assert opt.param_groups[0]["adjust_lr"] == "match_rms_adamw"


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is torch >= 2.9")
def test_with_torchs_settings_it_equals_torch_optim_muon():
    """Swapping torch.optim.Muon for rfsdp's with torch's settings (lr 1e-3,
    weight_decay 0.1, bf16 Newton-Schulz, given explicitly) gives torch's run
    (bit for bit on the machines tried; within 1e-6 of a 6e-3 displacement)."""
    torch.manual_seed(int(torch.randint(0, 2 ** 30, ()).item()))
    a = nn.Parameter(torch.randn(16, 24))
    b = nn.Parameter(a.detach().clone())
    ours = rfsdp.optim.Muon([a], lr=1e-3, weight_decay=0.1, ns_dtype=torch.bfloat16)
    ref = torch.optim.Muon([b], lr=1e-3, weight_decay=0.1)
    for _ in range(6):
        g = torch.randn(16, 24)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)


def test_the_one_line_swap_gives_biases_and_norms_to_adamw():
    """Muon(model.parameters()) as a torch user writes it: the matrices take Muon,
    the biases and norm weights AdamW with the group's lr and weight_decay and
    the AdamW part's betas and eps (reported once), as the float64 reference with
    those settings; an explicit use_muon=True group keeps refusing a bias."""
    import warnings
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 10), nn.LayerNorm(10), nn.Linear(10, 4))
    ref = ReferenceMuon({n: p.detach().double().clone() for n, p in model.named_parameters()},
                        [n for n, p in model.named_parameters() if p.dim() >= 2], lr=0.01,
                        weight_decay=0.1, aux_lr=0.01, aux_wd=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = rfsdp.optim.Muon(model.parameters(), lr=0.01, weight_decay=0.1)
    assert len(caught) == 1 and "4 0-D and 1-D parameters" in str(caught[0].message)
    for _ in range(3):
        x = torch.randn(5, 6)
        model.zero_grad()
        model(x).square().sum().backward()
        ref.step({n: p.grad for n, p in model.named_parameters()})
        opt.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach().double(), ref.p[n], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: "%s (seed %d): %s" % (n, seed, m))
    with pytest.raises(ValueError, match="give 0-D and 1-D parameters"):
        rfsdp.optim.Muon([dict(params=list(model.parameters()), use_muon=True)])
