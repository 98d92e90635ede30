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
from chaos import run_chaos  # noqa: E402


def test_seven_kills_lose_nothing(tmp_path):
    seed = int(torch.randint(0, 2 ** 20, ()).item())
    r = run_chaos(kills=7, steps=32, save_every=4, seed=seed, workdir=str(tmp_path))
    out = r["output"][-6000:]
    assert r["returncode"] == 0, "seed %d:\n%s" % (seed, out)
    assert r["kills"] == r["planned"] == 7, "seed %d: %d of 7 kills fired\n%s" % (seed, r["kills"], out)
    assert r["restarts"] == 7, out
    # every restart resumed from a checkpoint, but for those killed while loading
    assert r["resumed"] >= 7 - r["died_loading"], out
    assert r["compared"] > 20 and not r["differences"], (seed, r["differences"])
