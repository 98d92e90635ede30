"""run_ranks: one harness for the multi-process tests. Spawns `world` processes
in one Gloo group (a file rendezvous in a fresh folder), runs fn(rank, world,
*args) on each and returns every rank's result in rank order; an error on any
rank fails the caller with that rank's traceback, and ranks that are still
running after `timeout` seconds (a hang: a rank waiting in a collective the
others left) are killed and fail it too, each rank's threads' stacks on stderr
first.

fn must be a module-level function (it is pickled to the processes); its result
anything torch.save takes (tensors, lists, dicts). Each rank uses one thread."""
import faulthandler
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, fn, world, folder, args, timeout):
    torch.set_num_threads(1)
    # Before the caller kills a hang: every thread's stack, on stderr.
    faulthandler.dump_traceback_later(max(1, timeout - 3), exit=False)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(folder, "init"),
                            rank=rank, world_size=world)
    result = fn(rank, world, *args)
    torch.save(result, os.path.join(folder, "result%d.pt" % rank))
    dist.barrier()
    os._exit(0)  # (torch's Gloo threads may abort a normal exit: see rfsdp._comm)


def run_ranks(fn, world, *args, timeout=600):
    with tempfile.TemporaryDirectory() as folder:
        ctx = mp.spawn(_entry, args=(fn, world, folder, args, timeout), nprocs=world, join=False)
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError("run_ranks: %s on %d ranks still running after %d s (a rank "
                                   "waiting in a collective the others left?)"
                                   % (getattr(fn, "__name__", fn), world, timeout))
        return [torch.load(os.path.join(folder, "result%d.pt" % r), weights_only=False)
                for r in range(world)]
