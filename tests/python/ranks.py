"""run_ranks: one harness for the multi-process tests. Spawns `world` processes
in one Gloo group (a file rendezvous in a fresh folder), runs fn(rank, world,
*args) on each and returns every rank's result in rank order; an error on any
rank fails the caller with that rank's traceback, and ranks that are still
running after `timeout` seconds (a hang: a rank waiting in a collective the
others left) are killed and fail it too, each rank's threads' stacks on stderr
first.

fn must be a module-level function (it is pickled to the processes); its result
anything torch.save takes (tensors, lists, dicts). Each rank uses one thread.

torchrun / start_torchrun: the one way the tests launch a script under torchrun
(every command line built here)."""
import faulthandler
import os
import socket
import subprocess
import sys
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


def raised(fn, *args, **kw):
    """What fn(*args, **kw) raised, in a form a rank's result carries back: (the
    names of the exception's classes, its message); None if it raised nothing."""
    try:
        fn(*args, **kw)
    except Exception as e:  # noqa: BLE001
        return [c.__name__ for c in type(e).__mro__], str(e)
    return None


def assert_raised(got, cls, match):
    """got (from raised()) is a cls whose message matches the regular expression
    `match` (pytest.raises' test, on a rank's result)."""
    import re
    assert got is not None, "nothing raised; expected %s matching %r" % (cls.__name__, match)
    names, message = got
    assert cls.__name__ in names and re.search(match, message), (names[0], message)


def _start_torchrun(script, args, nproc, restarts, env, flags, stdout, stderr):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    if restarts:
        # torch's rendezvous shares its TCPStore with init_process_group by default, and
        # a restarted group may then read the dead attempt's Gloo addresses ("Connection
        # refused"; pytorch/pytorch#135712): a store of its own per attempt avoids it.
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *flags,
                             "--nproc_per_node", str(nproc), "--max-restarts", str(restarts),
                             script, *map(str, args)],
                            env=env, stdout=stdout, stderr=stderr, text=True)


def start_torchrun(script, args, log, nproc=2, restarts=0, env=None):
    """Starts `script args` under torchrun on this machine (one node, nproc
    processes, one thread each, restarted up to `restarts` times) and returns its
    Popen; every output line (torchrun's too) goes into the file `log` as it runs.
    (A pipe read only once the job ended fills up at 64 KiB and blocks the ranks'
    prints: a long run hangs.)"""
    with open(log, "w") as out:
        return _start_torchrun(script, args, nproc, restarts, env, ["--standalone"], out,
                               subprocess.STDOUT)


def torchrun(script, args, nproc=2, nnodes=1, restarts=0, env=None, timeout=600):
    """Runs `script args` under torchrun on this machine: nproc processes on each of
    nnodes simulated nodes (one torchrun each, a c10d rendezvous on a free local
    port: what a multi-node launch does), one thread each, restarted up to
    `restarts` times. Returns the CompletedProcess of node 0 after every node
    finished; raises, with every node's output tail, if one failed or ran past
    `timeout` seconds."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if nnodes == 1:
        launch = [["--standalone"]]
    else:
        launch = [["--nnodes", str(nnodes), "--node_rank", str(i), "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", "127.0.0.1:%d" % port, "--rdzv-id", "rfsdp-test"]
                  for i in range(nnodes)]
    with tempfile.TemporaryDirectory() as folder:
        # (output to files: a chatty rank never blocks on a pipe nobody reads)
        files = [(open(os.path.join(folder, "out%d" % i), "w+"),
                  open(os.path.join(folder, "err%d" % i), "w+")) for i in range(len(launch))]
        procs = [_start_torchrun(script, args, nproc, restarts, env, flags, out, err)
                 for flags, (out, err) in zip(launch, files)]
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise TimeoutError("torchrun %s: still running after %d s" % (script, timeout))
        texts = []
        for out, err in files:
            out.seek(0)
            err.seek(0)
            texts.append((out.read(), err.read()))
            out.close()
            err.close()
    failed = [(i, p.returncode, out[-2000:] + err[-3000:])
              for i, (p, (out, err)) in enumerate(zip(procs, texts)) if p.returncode != 0]
    if failed:
        raise RuntimeError("torchrun %s failed: %s" % (script, "; ".join(
            "node %d exited %d:\n%s" % f for f in failed)))
    return subprocess.CompletedProcess(procs[0].args, 0, texts[0][0], texts[0][1])
