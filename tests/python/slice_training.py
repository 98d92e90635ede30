"""The loop the multi-rank tests share: every rank trains on its slice of each
batch, so the ranks together see the whole batch the unsharded reference sees."""
import torch.distributed as dist
from torch import nn


def train_on_slices(model, opt, xs, ys, rank, world, loss_of=None, before_step=None,
                    after_step=None):
    """For each (x, y) of xs, ys (batch along dim 1): this rank's 1/world slice;
    the loss (mse_loss(model(x), y), or loss_of(model, x, y)); zero_grad, backward,
    before_step(), opt.step(), after_step(). Returns each step's loss averaged over
    the ranks."""
    per = xs.shape[1] // world
    losses = []
    for x, y in zip(xs, ys):
        xb, yb = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        loss = loss_of(model, xb, yb) if loss_of else nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        if before_step:
            before_step()
        opt.step()
        if after_step:
            after_step()
        t = loss.detach().clone()
        if world > 1:
            dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses
