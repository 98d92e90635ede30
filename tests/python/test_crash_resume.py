"""The main job survives a crash: torchrun (--max-restarts 1) on 2 ranks, the
last rank dies at step 10 of 12; the other fails (its collective loses the peer)
instead of hanging; torchrun restarts both, which resume from the step-8
checkpoint; the final parameters equal an uninterrupted run's, bit for bit."""
import os
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "..", "..", "examples", "train_gpt.py")
ARGS = ["--optimizer", "adamw8bit", "--steps", "12", "--dim", "64", "--layers", "1", "--heads", "2",
        "--ctx", "32", "--batch", "2", "--val-every", "1000", "--val-batches", "1",
        "--log-every", "1"]


def torchrun(extra, restarts=0, timeout=300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", str(restarts), JOB] + ARGS + extra
    # torch's rendezvous shares its TCPStore with init_process_group by default, and a
    # restarted group may then read the dead attempt's Gloo addresses ("Connection
    # refused"; pytorch/pytorch#135712): a store of its own per attempt avoids it.
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_crash_restart_resume_equals_an_uninterrupted_run():
    with tempfile.TemporaryDirectory() as d:
        text = os.path.join(d, "text.txt")
        g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 30, ()).item()))
        with open(text, "wb") as f:
            f.write(bytes(torch.randint(32, 127, (200000,), generator=g).tolist()))
        common = ["--text", text, "--plot", os.path.join(d, "p.png")]
        ref = torchrun(common + ["--save-final", os.path.join(d, "ref")])
        assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-3000:]
        run = torchrun(common + ["--checkpoint-dir", os.path.join(d, "ck"), "--save-every", "4",
                                 "--resume", "--crash-at-step", "10",
                                 "--save-final", os.path.join(d, "got")], restarts=1)
        out = run.stdout + run.stderr
        assert run.returncode == 0, out[-4000:]
        assert "resumed from" in out and "(step 8)" in out, out[-4000:]
        # the surviving rank said what happened, at once (not after the 300 s timeout)
        assert "the connection to a peer rank closed" in out, out[-4000:]
        assert sorted(os.listdir(os.path.join(d, "ck", "adamw8bit"))) == ["step_00000004",
                                                                          "step_00000008"]
        want = torch.load(os.path.join(d, "ref.adamw8bit.pt"))
        got = torch.load(os.path.join(d, "got.adamw8bit.pt"))
        assert want.keys() == got.keys()
        for n in want:
            assert torch.equal(want[n], got[n]), n
