"""A straightforward single-device Muon (+ AdamW for the other parameters) in
float64 on full tensors: the reference the Muon tests compare against. Written
from the algorithm's definition, independently of rfsdp."""
import math

import torch

NS = (3.4445, -4.7750, 2.0315)


def orthogonalise(g, steps=5):
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    a, b, c = NS
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def matrices(t, split=None, dim=0):
    """Views of the matrices of a full tensor (2-D: itself; 3-D: each expert; else
    (dim0, rest)), each cut into blocks of `split` rows (dim 0) or columns (dim 1)
    where given."""
    whole = [t[e] for e in range(t.shape[0])] if t.dim() == 3 else [t.view(t.shape[0], -1)]
    if split is None:
        return whole
    return [b for m in whole for b in torch.split(m, list(split), dim=dim)]


class ReferenceMuon:
    """params: name -> float64 tensor (updated in place); muon: the names Muon takes;
    splits: name -> row counts of its logical blocks (each its own matrix), or
    columns where split_dims[name] is 1. A parameter without a gradient (None) is
    skipped, as torch's optimizers skip it."""

    def __init__(self, params, muon, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0,
                 adjust_lr="original", aux_lr=3e-4, betas=(0.9, 0.95), eps=1e-10, aux_wd=0.0,
                 splits=None, momentum_dtype=None, split_dims=None):
        self.p, self.muon, self.splits = params, set(muon), dict(splits or {})
        self.split_dims = dict(split_dims or {})
        self.momentum_dtype = momentum_dtype  # (the momentum stored rounded to it, through fp32)
        self.hp = dict(lr=lr, momentum=momentum, nesterov=nesterov, wd=weight_decay,
                       adjust=adjust_lr, aux_lr=aux_lr, betas=betas, eps=eps, aux_wd=aux_wd)
        self.m = {n: torch.zeros_like(t) for n, t in params.items()}
        self.v = {n: torch.zeros_like(t) for n, t in params.items()}
        self.t = 0

    def step(self, grads, lr_scale=1.0):
        h = self.hp
        self.t += 1
        for n, w in self.p.items():
            if grads.get(n) is None:
                continue
            g = grads[n].double()
            if n in self.muon:
                beta = h["momentum"]
                m = beta * self.m[n] + (1 - beta) * g
                u = (1 - beta) * g + beta * m if h["nesterov"] else m
                self.m[n] = m if self.momentum_dtype is None \
                    else m.float().to(self.momentum_dtype).double()
                lr = h["lr"] * lr_scale
                split, dim = self.splits.get(n), self.split_dims.get(n, 0)
                for um, wm in zip(matrices(u, split, dim), matrices(w, split, dim)):
                    r, c = um.shape
                    scale = math.sqrt(max(1.0, r / c)) if h["adjust"] == "original" \
                        else 0.2 * math.sqrt(max(r, c))
                    wm.mul_(1 - lr * h["wd"]).sub_(lr * scale * orthogonalise(um))
            else:
                b1, b2 = h["betas"]
                lr = h["aux_lr"] * lr_scale
                self.m[n] = b1 * self.m[n] + (1 - b1) * g
                self.v[n] = b2 * self.v[n] + (1 - b2) * g * g
                mh = self.m[n] / (1 - b1 ** self.t)
                vh = self.v[n] / (1 - b2 ** self.t)
                w.mul_(1 - lr * h["aux_wd"]).sub_(lr * mh / (vh.sqrt() + h["eps"]))


def train(model, muon_names, xs, ys, **hyper):
    """ReferenceMuon(hyper) training `model`'s parameters (as float64 copies) on the
    batches xs, ys with mse_loss; the model computes each step's loss and gradients
    at the reference's parameters. Returns (losses, {name: float64 tensor})."""
    names = [n for n, _ in model.named_parameters()]
    ref = ReferenceMuon({n: p.detach().double().clone() for n, p in model.named_parameters()},
                        muon_names, **hyper)
    losses = []
    for x, y in zip(xs, ys):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(ref.p[n])
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        ref.step({n: p.grad for n, p in zip(names, model.parameters())})
    return losses, ref.p
