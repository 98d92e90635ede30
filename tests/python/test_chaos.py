"""Restarts under chaos, the short variant (scripts/chaos.sh runs the long one):
7 SIGKILLs of a rank (one inside an optimizer step after the first checkpoint,
then one each inside an all-gather, a step, a checkpoint's writes, after its
marker, while loading, and from outside at a random moment, in a random order) of
the main job's model trained with AdamW8bit and Shampoo under torchrun
--max-restarts; its final parameters and optimizer states equal an uninterrupted
run's bit for bit (tests/python/chaos.py)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import chaos  # noqa: E402
from chaos import run_chaos  # noqa: E402
from ranks import start_torchrun  # noqa: E402

CHATTY = '''
import os
line = "rank %s says %s\\n" % (os.environ["RANK"], "x" * 90)
for _ in range(2000):  # 200 KiB a rank: past a pipe's 64 KiB
    print(line, end="", flush=True)
print("rank %s done" % os.environ["RANK"], flush=True)
'''


def test_the_driver_reads_the_output_while_the_job_runs(tmp_path):
    """The driver's output capture under a job that prints 400 KiB: when it read a
    pipe only after the job ended, the ranks blocked at 64 KiB and the run hung
    until the driver's timeout."""
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    log = str(tmp_path / "output.log")
    proc = start_torchrun(str(script), [], log)
    out = chaos.drive(proc, str(tmp_path), [], 60, log)
    assert proc.returncode == 0, out[-2000:]
    for r in range(2):
        assert out.count("rank %d says" % r) == 2000 and "rank %d done" % r in out, out[-2000:]


def test_seven_kills_lose_nothing(tmp_path):
    seed = int(torch.randint(0, 2 ** 20, ()).item())
    r = run_chaos(kills=7, steps=32, save_every=4, seed=seed, workdir=str(tmp_path))
    out = r["output"][-6000:]
    assert r["returncode"] == 0, "seed %d:\n%s" % (seed, out)
    assert r["kills"] == r["planned"] == 7, "seed %d: %d of 7 kills fired\n%s" % (seed, r["kills"], out)
    assert r["restarts"] == 7, "seed %d: %d restarts for 7 kills\n%s" % (seed, r["restarts"], out)
    # every restart resumed from a checkpoint, but for those killed while loading
    assert r["resumed"] >= 7 - r["died_loading"], out
    assert r["compared"] > 20 and not r["differences"], (seed, r["differences"])
