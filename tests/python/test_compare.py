"""rfsdp.compare's math and report on constructed numbers (no training): the law's
fit, token and wall-clock speedups, best points, divergence, edges, missing runs,
the same optimizer under two names, fairness, schedules, shards."""
import json
import math
import os
import random
import subprocess
import sys

import pytest

from rfsdp import compare
from rfsdp.compare import config as C
from rfsdp.compare import analysis as R
from rfsdp.compare.law import Law, fit_law, token_speedup, wallclock_speedup

TRUE = Law(30.0, 0.35, 2.0)  # L(D) = 2 + 30 D^-0.35: 2.62 at 65536 tokens, 2.18 at 2M
BUDGETS = [2 ** k * 65536 for k in range(6)]


@pytest.mark.parametrize("n", [3, 4, 6])
def test_fit_recovers_a_law_from_exact_points(n):
    law = fit_law(BUDGETS[:n], [TRUE(d) for d in BUDGETS[:n]])
    assert law.alpha == pytest.approx(TRUE.alpha, rel=1e-7)
    assert law.B == pytest.approx(TRUE.B, rel=1e-8)
    assert law.beta == pytest.approx(TRUE.beta, rel=1e-9)
    assert max(abs(r) for r in law.residuals) < 1e-12
    # and as compare exports it
    assert compare.fit_law is fit_law


def test_fit_recovers_a_law_from_noisy_points_within_the_stated_error():
    """6 budgets (65536 .. 2M tokens), Gaussian noise sigma 0.003 on each loss, 50
    draws. Stated error (measured over 200 draws: the worst 0.0077, 1.46-1.53, B
    0.31-0.38 for the middle 95 %): the fitted curve within 3 sigma of the true one
    at every budget, a challenger at L(1.5 D) read as 1.5x within 5 %, B within 20 %."""
    sigma = 0.003
    for trial in range(50):
        rng = random.Random(trial)
        law = fit_law(BUDGETS, [TRUE(d) + rng.gauss(0, sigma) for d in BUDGETS])
        assert max(abs(law(d) - TRUE(d)) for d in BUDGETS) < 3 * sigma, (trial, law)
        s = token_speedup(law, TRUE(1.5 * BUDGETS[3]), BUDGETS[3], baseline_loss=TRUE(BUDGETS[3]))
        assert s == pytest.approx(1.5, rel=0.05), (trial, law, s)
        assert law.B == pytest.approx(TRUE.B, rel=0.2), (trial, law)


def test_fit_refuses_what_cannot_carry_a_law():
    with pytest.raises(ValueError, match="3 or more"):
        fit_law(BUDGETS[:2], [TRUE(d) for d in BUDGETS[:2]])
    with pytest.raises(ValueError, match="do not fall"):
        fit_law(BUDGETS[:4], [2.0, 2.1, 2.2, 2.3])


def test_fit_says_when_the_points_do_not_bend_like_the_law():
    """Losses that fall faster at the larger budgets (early in training: the main
    job's AdamW at 128K, 256K, 512K tokens fell 0.13 then 0.32) fit no power law with
    beta >= 0: beta is held at 0 and the law says so; a true law's points say nothing."""
    D = [131072, 262144, 524288]
    law = fit_law(D, [2.5754, 2.4479, 2.1279])
    assert law.beta == 0.0 and law.alpha > 0 and law.notes and "floor" in law.notes[0]
    assert max(abs(r) for r in law.residuals) > 0.03
    free = fit_law(D, [2.5754, 2.4479, 2.1279], beta_min=None)
    assert free.beta < 0 and any("end of its search range" in n for n in free.notes)
    assert fit_law(BUDGETS, [TRUE(d) for d in BUDGETS]).notes == []


def test_token_speedup_on_constructed_points():
    D = BUDGETS[2]
    # A challenger reaching at D what the law reaches at 2 D: 2x, re-centred or not.
    assert token_speedup(TRUE, TRUE(2 * D), D) == pytest.approx(2.0, rel=1e-12)
    assert token_speedup(TRUE, TRUE(2 * D), D, baseline_loss=TRUE(D)) == pytest.approx(2.0,
                                                                                      rel=1e-12)
    # Re-centred: the baseline off its law by +0.01 at D; a challenger 0.01 below
    # the baseline there is worth what 0.01 below the law is worth.
    off = TRUE(D) + 0.01
    want = (TRUE.budget_for(TRUE(D) - 0.01)) / D
    got = token_speedup(TRUE, off - 0.01, D, baseline_loss=off)
    assert got == pytest.approx(want, rel=1e-9) and got > 1
    # The baseline itself: exactly 1 (no rounding), wherever it lies.
    assert token_speedup(TRUE, off, D, baseline_loss=off) == 1.0
    # Worse than the baseline: below 1; beyond the law's floor: inf.
    assert token_speedup(TRUE, TRUE(D) + 0.05, D, baseline_loss=TRUE(D)) < 1
    assert math.isinf(token_speedup(TRUE, TRUE.beta - 0.1, D))
    assert compare.token_speedup is token_speedup


def test_wallclock_speedup_on_constructed_points():
    D = BUDGETS[1]
    # 2x the tokens' worth at 80 % of the baseline's throughput: 1.6x the time's.
    assert wallclock_speedup(TRUE, TRUE(2 * D), D, 800.0, 1000.0) == pytest.approx(1.6)
    assert wallclock_speedup(TRUE, TRUE(2 * D), D, 800.0, 1000.0,
                             baseline_loss=TRUE(D)) == pytest.approx(1.6)
    # equal losses, twice the throughput: 2x in time, 1x in tokens
    assert wallclock_speedup(TRUE, TRUE(D), D, 2000.0, 1000.0, baseline_loss=TRUE(D)) == 2.0


def test_interpolated_speedup_reads_the_baseline_points_without_a_law():
    pts = [(d, 3.0 - 0.2 * math.log2(d / 65536)) for d in (65536, 131072, 262144, 524288)]
    # a loss the baseline reaches at 3x the budget (between its 2x and 4x points)
    got = R.interpolated_speedup(pts, 3.0 - 0.2 * math.log2(3.0), 65536)
    assert got["bound"] is None and got["value"] == pytest.approx(3.0, rel=1e-12)
    same = R.interpolated_speedup(pts, pts[1][1], 131072)
    assert same["bound"] is None and same["value"] == pytest.approx(1.0, rel=1e-12)
    assert R.interpolated_speedup(pts, 2.0, 131072) == dict(value=4.0, bound="at least")
    assert R.interpolated_speedup(pts, 3.5, 131072) == dict(value=0.5, bound="at most")


# --- the report on constructed runs --------------------------------------------------

LRS = [1e-3, 2e-3, 4e-3, 8e-3]
MUON_LRS = [0.01, 0.02, 0.04]
SEED_DELTA = {0: -0.004, 1: 0.004}


def _config(**over):
    cfg = {"model": {"kind": "gpt", "width": 32, "layers": 1, "heads": 2, "ctx": 16},
           "data": "fortunes", "ranks": 2, "batch_tokens": 128,
           "budgets_tokens": [128 * 512 * 2 ** k for k in range(4)], "seeds": [0, 1],
           "baseline": "adamw",
           "optimizers": {"adamw": {"optimizer": "adamw", "lr": LRS, "weight_decay": [0.1]},
                          "adamw_again": {"optimizer": "adamw", "lr": LRS,
                                          "weight_decay": [0.1]},
                          "muon": {"optimizer": "muon", "lr": MUON_LRS}},
           "schedule": {"kind": "wsd", "warmup_fraction": 0.1, "decay_fraction": 0.2}}
    cfg.update(over)
    return C.load(cfg)


def _write_runs(cfg, folder, loss, tps, diverged=()):
    """A run file for every run of cfg: val loss loss(name, point, budget, seed)."""
    os.makedirs(os.path.join(folder, "runs"), exist_ok=True)
    C.save(cfg, folder)
    for run in C.expand(cfg):
        name = run["names"][0]
        rec = dict(key=run["key"], file=run["file"], optimizer=run["optimizer"],
                   names=run["names"], point=run["point"], budget=run["budget"],
                   seed=run["seed"], steps=run["steps"], steps_done=run["steps"],
                   tokens=run["budget"], error=None, diverged=False, diverged_step=None,
                   diverged_reason=None, val_loss=loss(name, run["point"], run["budget"],
                                                       run["seed"]),
                   train_loss=2.0, tokens_per_s=tps(name, run["seed"]), step_ms=10.0,
                   state_bytes_per_rank=[1000 if run["optimizer"] == "adamw" else 600] * 2,
                   peak_mib_per_rank=[500.0, 501.0], machine=dict(cpu="test CPU"))
        if (name, run["point"]["lr"], run["budget"], run["seed"]) in diverged:
            rec.update(diverged=True, diverged_step=7, val_loss=None,
                       diverged_reason="training loss not finite (nan) at step 7")
        with open(os.path.join(folder, "runs", run["file"]), "w") as f:
            json.dump(rec, f)


def _loss(name, point, budget, seed):
    """AdamW on TRUE at its best lr (4e-3: inside the grid) plus a quadratic penalty in
    log2(lr); Muon reaches at D what TRUE reaches at 1.5 D, best at lr 0.02; each
    seed shifted by SEED_DELTA, Muon's seed 1 by twice as much."""
    if name.startswith("adamw"):
        return TRUE(budget) + 0.01 * math.log2(point["lr"] / 4e-3) ** 2 + SEED_DELTA[seed]
    return (TRUE(1.5 * budget) + 0.02 * math.log2(point["lr"] / 0.02) ** 2
            + SEED_DELTA[seed] * (1 if seed == 0 else 2))


def _tps(name, seed):
    return 1000.0 if name.startswith("adamw") else (800.0 if seed == 0 else 700.0)


def test_report_on_constructed_runs(tmp_path):
    cfg = _config()
    _write_runs(cfg, str(tmp_path), _loss, _tps)
    lines = []
    res = compare.report(str(tmp_path), echo=lines.append, plot=False)
    text = "\n".join(lines)
    law = res["law"]
    # AdamW's best points lie on TRUE (seed deltas cancel): the law comes back.
    assert law["B"] == pytest.approx(TRUE.B, rel=1e-6) and law["beta"] == pytest.approx(2.0)
    for b in cfg["budgets_tokens"]:
        best = res["optimizers"]["adamw"]["best"][str(b)]
        assert best["lr"] == 4e-3 and best["weight_decay"] == 0.1 and best["edge"] == []
        m = res["optimizers"]["muon"]["best"][str(b)]
        assert m["lr"] == 0.02 and m["val_loss"] == pytest.approx(TRUE(1.5 * b) + 0.002)
        tok = res["optimizers"]["muon"]["token_speedup"][str(b)]
        # value: from the seed means (Muon's mean is +0.002 off TRUE(1.5 D))
        assert tok["value"] == pytest.approx(
            token_speedup(TRUE, TRUE(1.5 * b) + 0.002, b, baseline_loss=TRUE(b)), rel=1e-6)
        # the range over seeds: paired per-seed speedups
        s0 = token_speedup(TRUE, TRUE(1.5 * b) - 0.004, b, baseline_loss=TRUE(b) - 0.004)
        s1 = token_speedup(TRUE, TRUE(1.5 * b) + 0.008, b, baseline_loss=TRUE(b) + 0.004)
        assert tok["low"] == pytest.approx(min(s0, s1), rel=1e-6)
        assert tok["high"] == pytest.approx(max(s0, s1), rel=1e-6)
        assert s0 == pytest.approx(1.5, rel=1e-6) and tok["low"] < 1.5 < tok["high"] + 1e-9
        wall = res["optimizers"]["muon"]["wallclock_speedup"][str(b)]
        assert wall["value"] == pytest.approx(tok["value"] * 750.0 / 1000.0, rel=1e-9)
        assert wall["low"] == pytest.approx(min(s0 * 0.8, s1 * 0.7), rel=1e-6)
        ip = res["optimizers"]["muon"]["interpolated_speedup"][str(b)]
        if b < cfg["budgets_tokens"][-1]:  # inside the baseline's points: about 1.5
            assert ip["bound"] is None and ip["value"] == pytest.approx(1.5, rel=0.05)
        else:
            assert ip == dict(value=1.0, bound="at least")
        # the same optimizer under two names: 1, exactly
        again = res["optimizers"]["adamw_again"]
        for key in ("token_speedup", "wallclock_speedup"):
            assert (again[key][str(b)]["value"], again[key][str(b)]["low"],
                    again[key][str(b)]["high"]) == (1.0, 1.0, 1.0)
    assert res["optimizers"]["muon"]["state_bytes_per_rank"] == 600
    assert res["optimizers"]["adamw"]["state_bytes_per_rank"] == 1000
    assert res["missing"] == []
    assert "L(D) = 2.0000" in text and "residuals" in text and "MISSING" not in text
    on_disk = json.load(open(tmp_path / "results.json"))
    assert set(on_disk) >= {"baseline", "law", "optimizers"}
    assert set(on_disk["law"]) >= {"alpha", "B", "beta"}
    for o in on_disk["optimizers"].values():
        assert set(o) >= {"best", "token_speedup", "wallclock_speedup", "state_bytes_per_rank",
                          "runs"}
        assert {"value", "low", "high"} <= set(next(iter(o["token_speedup"].values())))


def test_a_diverged_run_is_recorded_and_excluded_from_best(tmp_path):
    cfg = _config()
    b = cfg["budgets_tokens"][1]
    # Muon's best lr (0.02) diverged in seed 1 at budget b: 0.02 is out there.
    _write_runs(cfg, str(tmp_path), _loss, _tps, diverged={("muon", 0.02, b, 1)})
    lines = []
    res = compare.report(str(tmp_path), echo=lines.append, plot=False)
    best = res["optimizers"]["muon"]["best"]
    assert best[str(b)]["lr"] in (0.01, 0.04)
    assert all(best[str(o)]["lr"] == 0.02 for o in cfg["budgets_tokens"] if o != b)
    runs = [r for r in res["optimizers"]["muon"]["runs"] if r["diverged"]]
    assert len(runs) == 1 and runs[0]["diverged_step"] == 7 and "not finite" in \
        runs[0]["diverged_reason"]
    assert any("excluded from best" in l for l in lines)
    assert any("diverged at step 7" in l for l in lines)


def test_a_best_point_on_the_grid_edge_is_flagged(tmp_path):
    cfg = _config()

    def loss(name, point, budget, seed):  # AdamW would like a larger lr than 8e-3
        if name.startswith("adamw"):
            return TRUE(budget) + 0.01 * math.log2(point["lr"] / 2e-2) ** 2 + SEED_DELTA[seed]
        return _loss(name, point, budget, seed)
    _write_runs(cfg, str(tmp_path), loss, _tps)
    lines = []
    res = compare.report(str(tmp_path), echo=lines.append, plot=False)
    edge = res["optimizers"]["adamw"]["best"][str(cfg["budgets_tokens"][0])]["edge"]
    assert edge and "lr=0.008 is the largest" in edge[0] and "widen the grid" in edge[0]
    assert res["optimizers"]["muon"]["best"][str(cfg["budgets_tokens"][0])]["edge"] == []
    assert any("widen the grid" in l for l in lines)


def test_a_report_with_a_missing_run_says_which(tmp_path):
    cfg = _config()
    _write_runs(cfg, str(tmp_path), _loss, _tps)
    gone = [r for r in C.expand(cfg) if r["optimizer"] == "muon"][5]
    os.remove(tmp_path / "runs" / gone["file"])
    lines = []
    res = compare.report(str(tmp_path), echo=lines.append, plot=False)
    assert len(res["missing"]) == 1
    m = res["missing"][0]
    assert (m["optimizer"], m["budget"], m["seed"], m["point"], m["file"]) == (
        "muon", gone["budget"], gone["seed"], gone["point"], gone["file"])
    text = "\n".join(lines)
    assert "MISSING 1 run" in text and gone["file"] in text


def test_too_few_baseline_budgets_give_no_law_and_say_why(tmp_path):
    cfg = _config(budgets_tokens=[65536, 131072])
    _write_runs(cfg, str(tmp_path), _loss, _tps)
    lines = []
    res = compare.report(str(tmp_path), echo=lines.append, plot=False)
    assert res["law"] is None and "3 or more" in res["law_error"]
    assert res["optimizers"]["muon"]["token_speedup"] == {}
    assert any("no law for adamw" in l for l in lines)


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    cfg = _config()
    _write_runs(cfg, str(tmp_path), _loss, _tps, diverged={("muon", 0.04, 65536, 0)})
    compare.report(str(tmp_path), echo=lambda *a: None)
    for name in ("loss_vs_tokens.png", "speedup.png", "lr_sensitivity.png"):
        assert (tmp_path / name).stat().st_size > 10000, name


# --- the config -------------------------------------------------------------------------

def test_an_unfair_config_is_refused_naming_the_grids():
    with pytest.raises(C.ConfigError) as e:
        _config(optimizers={"adamw": {"optimizer": "adamw", "lr": [1e-3, 3e-3]},
                            "muon": {"optimizer": "muon", "lr": [0.01, 0.02, 0.04]}})
    msg = str(e.value)
    assert "'adamw' (adamw): 2 points (lr 2)" in msg and "'muon' (muon): 3 points (lr 3)" in msg
    # as many points but a narrower lr span: refused too
    with pytest.raises(C.ConfigError, match="span"):
        _config(optimizers={"adamw": {"optimizer": "adamw", "lr": [1e-3, 2e-3],
                                      "weight_decay": [0.0, 0.1]},
                            "muon": {"optimizer": "muon", "lr": [0.01, 0.1]}})
    # the baseline wider: accepted
    _config(optimizers={"adamw": {"optimizer": "adamw", "lr": [1e-3, 3e-3, 1e-2]},
                        "muon": {"optimizer": "muon", "lr": [0.01, 0.03]}})


def test_config_errors_say_what():
    with pytest.raises(C.ConfigError, match="takes no 'momentun'"):
        _config(optimizers={"adamw": {"optimizer": "adamw", "lr": [1e-3, 3e-3]},
                            "muon": {"optimizer": "muon", "lr": [0.02], "momentun": [0.9]}})
    with pytest.raises(C.ConfigError, match="unknown optimizer"):
        _config(optimizers={"adamw": {"optimizer": "adamw", "lr": [1e-3]},
                            "x": {"optimizer": "muon:int3", "lr": [0.02]}})
    with pytest.raises(C.ConfigError, match="not multiples of batch_tokens"):
        _config(budgets_tokens=[1000, 2048])
    with pytest.raises(C.ConfigError, match="missing seeds"):
        cfg = _config()
        del cfg["seeds"]
        C.load(cfg)
    with pytest.raises(C.ConfigError, match="must be a non-empty list"):
        _config(optimizers={"adamw": {"optimizer": "adamw", "lr": [1e-3], "weight_decay": 0.1}})


def test_runs_shards_and_shared_names():
    cfg = _config()
    runs = C.expand(cfg)
    # adamw and adamw_again share every run
    assert len(runs) == len(cfg["budgets_tokens"]) * 2 * (len(LRS) + len(MUON_LRS))
    shared = [r for r in runs if r["optimizer"] == "adamw"]
    assert all(r["names"] == ["adamw", "adamw_again"] for r in shared)
    assert len({r["key"] for r in runs}) == len(runs) == len({r["file"] for r in runs})
    # shards partition the runs
    parts = [C.shard(runs, *C.parse_shard("%d/3" % i)) for i in (1, 2, 3)]
    assert sorted(r["key"] for p in parts for r in p) == sorted(r["key"] for r in runs)
    assert abs(len(parts[0]) - len(parts[2])) <= 1
    with pytest.raises(C.ConfigError):
        C.parse_shard("0/2")
    # a run's key follows what trains it, not the name, and changes with the budget
    k = C.run_key(cfg, "adamw", {"lr": 1e-3, "weight_decay": 0.1}, 65536, 0)
    assert k == C.run_key(dict(cfg, baseline="other"), "adamw",
                          {"lr": 1e-3, "weight_decay": 0.1}, 65536, 0)
    assert k != C.run_key(cfg, "adamw", {"lr": 1e-3, "weight_decay": 0.1}, 131072, 0)
    assert k != C.run_key(cfg, "adamw8bit", {"lr": 1e-3, "weight_decay": 0.1}, 65536, 0)


def test_schedules_end_at_the_budget():
    wsd = dict(kind="wsd", warmup_fraction=0.1, decay_fraction=0.2, min_lr_fraction=0.0)
    f = [C.lr_factor(wsd, s, 100) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == 1.0 and f[10:80] == [1.0] * 70
    assert f[80] == 1.0 and f[99] == pytest.approx(0.05) and f == sorted(f[:10]) + f[10:]
    assert all(a >= b for a, b in zip(f[9:], f[10:]))
    cos = dict(kind="cosine", warmup_fraction=0.1, decay_fraction=0.0, min_lr_fraction=0.1)
    g = [C.lr_factor(cos, s, 100) for s in range(100)]
    assert g[9] == 1.0 and g[10] == 1.0 and g[99] == pytest.approx(0.1, abs=0.01)
    assert all(a >= b for a, b in zip(g[9:], g[10:]))


def test_the_command_line():
    out = subprocess.run([sys.executable, "-m", "rfsdp.compare", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "run" in out.stdout and "report" in out.stdout
    script = os.path.join(os.path.dirname(sys.executable), "rfsdp-compare")
    assert os.path.exists(script), "pip install (-e) . installs rfsdp-compare beside python"
    out = subprocess.run([script, "report", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "DIR" in out.stdout.upper()


def test_importing_compare_needs_no_matplotlib():
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "import rfsdp.compare, rfsdp.compare.analysis, rfsdp.compare.sweep\n"
            "print(rfsdp.compare.analysis.plots({}, {}, '.'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]


# --- coordinate descent ---------------------------------------------------------------

def _fake_trainer(loss, calls):
    """A trainer for sweep.run that writes each run's record from loss(point, budget,
    seed) (None: diverged) instead of training."""
    def train(cfg, out, runs):
        calls.append(len(runs))
        for run in runs:
            v = loss(run["point"], run["budget"], run["seed"])
            rec = dict(key=run["key"], file=run["file"], optimizer=run["optimizer"],
                       names=run["names"], point=run["point"], budget=run["budget"],
                       seed=run["seed"], steps=run["steps"], error=None,
                       diverged=v is None, diverged_step=3 if v is None else None,
                       diverged_reason="constructed" if v is None else None, val_loss=v,
                       train_loss=v, tokens_per_s=1000.0, step_ms=1.0,
                       state_bytes_per_rank=[8, 8], peak_mib_per_rank=[1.0, 1.0],
                       machine=dict(cpu="test CPU"), params=1000)
            with open(os.path.join(out, "runs", run["file"]), "w") as f:
                json.dump(rec, f)
    return train


def test_coordinate_descent_finds_the_best_of_a_separable_grid_with_fewer_runs(tmp_path):
    lrs = [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2]
    wds = [0.0, 0.05, 0.1, 0.2]
    b1s = [0.8, 0.9, 0.95]
    cfg = _config(search="coordinate", seeds=[0, 1], budgets_tokens=[65536, 131072, 262144],
                  optimizers={"adamw": {"optimizer": "adamw", "lr": lrs, "weight_decay": wds,
                                        "betas": [[b, 0.999] for b in b1s]}})

    def loss(point, budget, seed):
        if point["lr"] == 3.2e-2:
            return None  # diverges
        best_lr = 8e-3 if budget < 262144 else 4e-3
        return (TRUE(budget) + 0.01 * math.log2(point["lr"] / best_lr) ** 2
                + (point["weight_decay"] - 0.05) ** 2 + (point["betas"][0] - 0.9) ** 2
                + 0.001 * seed)
    calls = []
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    lines = []
    from rfsdp.compare.sweep import run as sweep_run
    res = sweep_run(str(path), str(tmp_path), echo=lines.append,
                    trainer=_fake_trainer(loss, calls))
    trained = len(os.listdir(tmp_path / "runs"))
    full = len(C.expand(cfg))
    assert trained < full / 2, (trained, full)  # measured: 66 of 432, in 4 rounds
    assert len(calls) >= 3  # rounds: start, then each axis
    for b in cfg["budgets_tokens"]:
        best = res["optimizers"]["adamw"]["best"][str(b)]
        assert (best["lr"], best["weight_decay"], best["betas"]) == (
            8e-3 if b < 262144 else 4e-3, 0.05, [0.9, 0.999]), best
        assert res["optimizers"]["adamw"]["descent"][str(b)]["ended"]
    assert res["missing"] == [] and res["law"] is not None
    assert any("coordinate descent, round 1" in l for l in lines)
    # Run again: nothing to train, the same answer.
    calls.clear()
    sweep_run(str(path), str(tmp_path), echo=lambda *a: None, trainer=_fake_trainer(loss, calls))
    assert calls == []


def test_coordinate_descent_mid_way_reports_what_it_needs(tmp_path):
    cfg = _config(search="coordinate", seeds=[0], budgets_tokens=[65536, 131072, 262144],
                  optimizers={"adamw": {"optimizer": "adamw", "lr": [1e-3, 2e-3, 4e-3],
                                        "weight_decay": [0.0, 0.1], "start": {"lr": 1e-3}}})
    from rfsdp.compare.search import coordinate_state, start_point
    assert start_point(cfg["optimizers"]["adamw"]) == {"lr": 1e-3, "weight_decay": 0.0}
    os.makedirs(tmp_path / "runs")
    C.save(cfg, str(tmp_path))
    state, need = coordinate_state(cfg, {})
    assert len(need) == 3 and all(r["point"] == {"lr": 1e-3, "weight_decay": 0.0} for r in need)
    lines = []
    res = compare.report(str(tmp_path), echo=lines.append, plot=False)
    assert len(res["missing"]) == 3  # the start points only, not the whole grid
    assert any("not ended" in l for l in lines)
    # shards split the descents
    s1, _ = coordinate_state(cfg, {}, 0, 2)
    s2, _ = coordinate_state(cfg, {}, 1, 2)
    assert sorted(s1) + sorted(s2) != [] and not set(s1) & set(s2) and len(s1) + len(s2) == 3
    with pytest.raises(C.ConfigError, match="start"):
        _config(optimizers={"adamw": {"optimizer": "adamw", "lr": [1e-3], "start": {"lr": 5.0}}})


def test_grid_resume_and_shards_train_each_run_once(tmp_path):
    cfg = _config(seeds=[0], budgets_tokens=[65536, 131072, 262144])
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    from rfsdp.compare.sweep import run as sweep_run
    trained = []

    def trainer(cfg, out, runs):
        trained.append([r["file"] for r in runs])
        _fake_trainer(lambda p, b, s: _loss("muon" if "lr" in p and p["lr"] >= 0.01 else
                                            "adamw", p, b, s), [])(cfg, out, runs)
    quiet = lambda *a: None  # noqa: E731
    sweep_run(str(path), str(tmp_path), shard="1/2", echo=quiet, trainer=trainer, report=False)
    sweep_run(str(path), str(tmp_path), shard="2/2", echo=quiet, trainer=trainer, report=False)
    every = [r["file"] for r in C.expand(C.load(str(path)))]
    assert sorted(trained[0] + trained[1]) == sorted(every) and not set(trained[0]) & set(
        trained[1])
    sweep_run(str(path), str(tmp_path), echo=quiet, trainer=trainer, report=False)
    assert trained[2] == []  # all there: nothing trains
    os.remove(tmp_path / "runs" / every[4])
    lines = []
    res = sweep_run(str(path), str(tmp_path), echo=lines.append, trainer=trainer)
    assert trained[3] == [every[4]] and res["missing"] == []
    assert any("20 already in" in l and "1 to train" in l for l in lines)


def test_runs_per_launch_splits_the_launches_and_a_crash_fails_one_run(tmp_path, monkeypatch):
    """runs_per_launch N: one torchrun per N runs (a fresh process for each N: peak
    memory then counts only those runs); a launch that dies fails the run it held, and the rest of
    that launch's runs and the later launches still train."""
    from rfsdp.compare import sweep
    cfg = _config(seeds=[0], budgets_tokens=[65536, 131072, 262144], runs_per_launch=4)
    runs = C.expand(cfg)
    launches = []

    def fake_launch(cfg, out, batch, offset, total, *a, **k):
        launches.append([r["file"] for r in batch])
        for i, r in enumerate(batch):
            if len(launches) == 2 and i == 1:  # the second launch dies in its second run
                return 3, ["boom"]
            _fake_trainer(lambda p, b, s: 2.0, [])(cfg, out, [r])
        return 0, []
    monkeypatch.setattr(sweep, "launch", fake_launch)
    os.makedirs(tmp_path / "runs")
    lines = []
    failures = sweep._train(cfg, str(tmp_path), runs, lines.append)
    assert failures == 1 and [len(b) for b in launches[:2]] == [4, 4]
    assert launches[2][:2] == launches[1][2:]  # the rest of the dead launch, first
    assert all(len(b) <= 4 for b in launches)
    recs = [json.load(open(tmp_path / "runs" / r["file"])) for r in runs]
    assert [r["file"] for r in recs if r["error"]] == [launches[1][1]]
    assert "exited with code 3" in next(r["error"] for r in recs if r["error"])
    assert sum(len(b) for b in launches) == len(runs) + 2  # the dead launch's last 2 again
    assert _config()["runs_per_launch"] == 0  # the default: every run in one launch
