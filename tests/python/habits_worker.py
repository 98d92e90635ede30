"""Run by test_habits.py under torchrun (or alone, for the one-process reference):
flows users bring, on the small Net of models.py.

  habits_worker.py lightning OPTIMIZER OUT   PyTorch Lightning's Trainer, DDP on the CPU
                                              (torchrun's ranks), an rfsdp optimizer
  habits_worker.py plain OPTIMIZER OUT       the same training as a plain loop, one process
  habits_worker.py hsdp OUT                  rfsdp.fully_shard over a (node, rank) mesh:
                                              HSDP across simulated nodes, AdamW
Each writes {name: full parameter} after training to OUT (rank 0)."""
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import Net, data, optimizer  # noqa: E402

SEED = 4


def batches():
    xs, ys = data(SEED)
    return xs, ys  # STEPS batches of 16


def plain(name, out):
    torch.manual_seed(SEED)
    model = Net()
    opt = optimizer(name, model.parameters())
    xs, ys = batches()
    for x, y in zip(xs, ys):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, out)


def lightning(name, out):
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(SEED)
            self.net = Net()

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return optimizer(name, self.net.parameters())

    xs, ys = batches()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    # One global batch of 16 a step, each rank its half in order (Lightning's own
    # sampler would shuffle: this is the one-process run's data, split).
    ds = TensorDataset(xs.reshape(-1, xs.shape[-1]), ys.reshape(-1, ys.shape[-1]))
    sampler = [i for s in range(xs.shape[0]) for i in range(s * 16 + rank * 16 // world,
                                                            s * 16 + (rank + 1) * 16 // world)]
    loader = DataLoader(ds, batch_size=16 // world, sampler=sampler)
    module = Module()
    trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=world, max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(module, loader)
    assert not isinstance(sampler, DistributedSampler)
    if trainer.global_rank == 0:
        torch.save({n: p.detach().clone() for n, p in module.net.named_parameters()}, out)


def hsdp(out):
    import rfsdp
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo")
    nodes = int(os.environ["GROUP_WORLD_SIZE"])
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (nodes, per_node), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(SEED)
    model = Net()
    for b in model.blocks:
        rfsdp.fully_shard(b, mesh=mesh)
    rfsdp.fully_shard(model, mesh=mesh)
    opt = optimizer("AdamW", model.parameters())
    xs, ys = batches()
    world, rank = dist.get_world_size(), dist.get_rank()
    for x, y in zip(xs, ys):  # each rank its share of the global batch
        lo, hi = rank * 16 // world, (rank + 1) * 16 // world
        loss = nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi])
        opt.zero_grad()
        loss.backward()
        opt.step()
    full = rfsdp.full_parameters(model)
    if rank == 0:
        torch.save(full, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    what = sys.argv[1]
    if what == "plain":
        plain(sys.argv[2], sys.argv[3])
    elif what == "lightning":
        lightning(sys.argv[2], sys.argv[3])
    elif what == "hsdp":
        hsdp(sys.argv[2])
    else:
        raise SystemExit(__doc__)
