"""rfsdp.compare's sweep machinery on real runs (torchrun, 2 ranks, Gloo) of tiny
models for a handful of steps: every run a JSON file, shards, resume, a diverging
configuration recorded and excluded, the same optimizer under two names exactly 1,
a crashed worker recorded as a failed run while the sweep goes on."""
import json
import os

import pytest

from rfsdp import compare

HERE = os.path.dirname(os.path.abspath(__file__))
FORTUNES = "/usr/share/games/fortunes"


def _gpt_config():
    return {"model": {"kind": "gpt", "width": 32, "layers": 1, "heads": 2, "ctx": 16},
            "data": "fortunes", "ranks": 2, "batch_tokens": 128,
            "budgets_tokens": [384, 768, 1536], "seeds": [0], "val_tokens": 1024,
            "divergence_window": 3, "baseline": "adamw",
            "optimizers": {
                # lr 1000 diverges at once
                "adamw": {"optimizer": "adamw", "lr": [3e-3, 1e-2, 1e3], "weight_decay": [0.1]},
                "adamw_again": {"optimizer": "adamw", "lr": [3e-3, 1e-2, 1e3],
                                "weight_decay": [0.1]},
                "muon": {"optimizer": "muon", "lr": [0.02, 0.05]}},
            "schedule": {"kind": "wsd", "warmup_fraction": 0.1, "decay_fraction": 0.3}}


def _run(cfg_path, out, shard="1/1"):
    lines = []
    res = compare.run(cfg_path, out, shard=shard, echo=lines.append)
    return res, "\n".join(lines)


def test_a_sweep_trains_resumes_and_reports(tmp_path):
    assert os.path.isdir(FORTUNES), "install Debian's fortunes (scripts/test.sh does)"
    cfg_path = tmp_path / "sweep.json"
    cfg_path.write_text(json.dumps(_gpt_config()))
    out = str(tmp_path / "out")
    # Machine 1 of 2: half the runs; its report names the other half as missing.
    res, text = _run(str(cfg_path), out, "1/2")
    assert "15 runs in the sweep (8 in shard 1/2); 0 already in" in text, text[-3000:]
    assert "[compare] run 1 of 8:" in text and "[compare] run 8 of 8:" in text
    assert "elapsed" in text and "left" in text
    assert len(res["missing"]) == 7 and "MISSING 7 run(s)" in text
    assert res["missing"][0]["file"] in text
    # Machine 2 of 2 into the same folder: the rest, and a complete report.
    res, text = _run(str(cfg_path), out, "2/2")
    assert "(7 in shard 2/2); 0 already in" in text and "[compare] run 7 of 7:" in text
    files = sorted(os.listdir(os.path.join(out, "runs")))
    assert len(files) == 15 and res["missing"] == [] and "MISSING" not in text
    recs = [json.load(open(os.path.join(out, "runs", f))) for f in files]
    for r in recs:
        for k in ("config", "val_loss", "train_loss", "tokens_per_s", "step_ms",
                  "peak_mib_per_rank", "state_bytes_per_rank", "diverged", "diverged_step",
                  "diverged_reason", "machine"):
            assert k in r, (k, r["file"])
        assert len(r["state_bytes_per_rank"]) == 2 and len(r["peak_mib_per_rank"]) == 2
        assert r["config"]["model"]["width"] == 32
    # lr 1000 diverged at every budget: recorded with its step and reason, not best
    bad = [r for r in recs if r["point"]["lr"] == 1e3]
    assert len(bad) == 3 and all(r["diverged"] and r["diverged_step"] >= 1 and r["diverged_reason"]
                                 and r["val_loss"] is None for r in bad), bad
    ok = [r for r in recs if r["point"]["lr"] != 1e3]
    assert all(not r["diverged"] and r["val_loss"] < r["first_loss"] for r in ok)
    assert all(r["state_bytes_per_rank"][0] > 0 and r["tokens_per_s"] > 0 for r in ok)
    # The optimizer's metrics of the last step (2 ranks: bytes sent; Muon: its matrices)
    for r in ok:
        last = r["optimizer_metrics"]["last_step"]
        assert last["step"] == r["steps_done"] and last["bytes_sent_total"] > 0
        assert all(g["update_rms"] > 0 for g in last["groups"] if g["update_rms"] is not None)
        assert (sum(g["matrices_orthogonalised"] for g in last["groups"]) > 0) == \
            (r["optimizer"] == "muon"), r["optimizer"]
    assert "update rms" in text and "kB sent" in text
    best = res["optimizers"]["adamw"]["best"]
    assert all(best[str(b)]["lr"] != 1e3 for b in (384, 768, 1536))
    # the law and the speedups; the same optimizer under another name: exactly 1
    assert res["law"] is not None and res["law"]["alpha"] > 0
    again = res["optimizers"]["adamw_again"]
    for b in ("384", "768", "1536"):
        for key in ("token_speedup", "wallclock_speedup"):
            assert again[key][b]["value"] == 1.0 and again[key][b]["low"] == 1.0
        assert res["optimizers"]["muon"]["token_speedup"][b]["value"] > 0
    assert os.path.exists(os.path.join(out, "results.json"))
    assert "excluded from best (3)" in text
    # Resume: everything is there, nothing trains, no file changes.
    stamps = {f: os.path.getmtime(os.path.join(out, "runs", f)) for f in files}
    res, text = _run(str(cfg_path), out)
    assert "15 already in" in text and "0 to train" in text and "[compare] run " not in text
    assert stamps == {f: os.path.getmtime(os.path.join(out, "runs", f)) for f in files}
    # A lost run: only it trains again.
    gone = [f for f in files if f.startswith("muon-D768")][0]
    os.remove(os.path.join(out, "runs", gone))
    res, text = _run(str(cfg_path), out)
    assert "14 already in" in text and "1 to train" in text
    assert "[compare] run 1 of 1: muon" in text and os.path.exists(os.path.join(out, "runs", gone))
    assert stamps[files[0]] == os.path.getmtime(os.path.join(out, "runs", files[0]))


def test_a_callable_model_and_a_crashed_worker(tmp_path, monkeypatch):
    """A model from a factory; the worker's rank 1 dies building one run (seed 1's
    first): that run is recorded as failed (with the exit code), the sweep resumes
    with the next run and finishes."""
    monkeypatch.setenv("PYTHONPATH", HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    marker = str(tmp_path / "crashed")
    cfg = {"model": {"kind": "callable", "factory": "models:crash_once_lm", "ctx": 16,
                     "width": 16, "marker": marker},
           "data": "fortunes", "ranks": 2, "batch_tokens": 128,
           "budgets_tokens": [256, 512, 1024], "seeds": [0, 1], "val_tokens": 1024,
           "baseline": "adamw",
           "optimizers": {"adamw": {"optimizer": "adamw", "lr": [1e-2, 3e-2]},
                          "muon": {"optimizer": "muon", "lr": [0.02, 0.05]}},
           "schedule": {"kind": "cosine", "warmup_fraction": 0.2}}
    cfg_path = tmp_path / "c.json"
    cfg_path.write_text(json.dumps(cfg))
    out = str(tmp_path / "out")
    res, text = _run(str(cfg_path), out)
    assert os.path.exists(marker)
    failed = [r for o in res["optimizers"].values() for r in o["runs"] if r["error"]]
    assert len(failed) == 1 and failed[0]["seed"] == 1 and "exited with code" in failed[0]["error"]
    assert "FAILED" in text and "failed: the worker exited" in text
    ok = [r for o in res["optimizers"].values() for r in o["runs"] if not r["error"]]
    assert len(ok) == 23 and all(not r["diverged"] for r in ok)
    # Muon took the hidden Linear layers (its state: momentum of fc and mix, and the
    # AdamW moments of the rest), and the runs were sharded: each rank holds part.
    m = [r for r in res["optimizers"]["muon"]["runs"] if not r["error"]][0]
    assert 0 < m["state_bytes_per_rank"][0] and 0 < m["state_bytes_per_rank"][1]
    assert res["law"] is not None
