"""`report DIR`: from DIR/config.json and the runs in DIR/runs, per optimizer and
budget the best configuration (lowest validation loss averaged over seeds; a point
with a diverged or failed seed is excluded), the baseline's law fitted to its best
points, and per challenger and budget the token and wall-clock speedups with their
range over seeds; a terminal table, DIR/results.json and PNGs (matplotlib, when
installed).

Speedups (see law.py): the law is re-centred through the baseline's best loss at
each budget, so the baseline is 1 there by construction and the same optimizer
under two names is exactly 1. The value uses the seed-averaged losses; the interval
[low, high] is the range, over the seeds both best points finished, of the paired
per-seed speedups (seed s of the challenger against seed s of the baseline, through
the law fitted to the seed-averaged baseline points). It is a range, not a
confidence interval: with 2 seeds it is the two values, with 1 seed a point."""
import glob
import json
import math
import os

from . import config as C
from .law import fit_law, token_speedup

MiB = 2 ** 20


def _load_runs(out):
    runs = {}
    for path in sorted(glob.glob(os.path.join(out, "runs", "*.json"))):
        try:
            with open(path) as f:
                rec = json.load(f)
        except (OSError, ValueError) as e:
            print("[compare] unreadable run file %s (%s): ignored" % (path, e))
            continue
        runs[rec["key"]] = rec
    return runs


def _ok(rec):
    return (not rec.get("error") and not rec.get("diverged") and rec.get("val_loss") is not None
            and math.isfinite(rec["val_loss"]))


def _mean(v):
    v = [x for x in v if x is not None]
    return sum(v) / len(v) if v else None


def _fmt_point(point):
    return " ".join("%s=%s" % (k, _num(v)) for k, v in point.items())


def _num(v):
    if isinstance(v, float):
        return "%.4g" % v
    return json.dumps(v, separators=(",", ":")) if isinstance(v, (list, dict)) else str(v)


def _tokens(n):
    return "%.3gM" % (n / 1e6) if n >= 1e6 else "%.3gK" % (n / 1e3) if n >= 1e3 else str(n)


def _finite(x):
    return None if x is None or not math.isfinite(x) else x


def _interval(value, per_seed):
    vals = [v for v in per_seed.values() if v is not None]
    out = dict(value=_finite(value), low=_finite(min(vals)) if vals else None,
               high=_finite(max(vals)) if vals else None, per_seed=per_seed_json(per_seed))
    if value is not None and math.isinf(value):
        out["note"] = "beyond the law's floor (beta): the baseline's law never reaches this loss"
    return out


def per_seed_json(d):
    return {str(k): _finite(v) for k, v in d.items()}


def interpolated_speedup(points, loss, budget):
    """A cross-check of the law's token speedup that assumes no law: the budget at
    which the baseline's measured best points reach `loss`, linear in log budget
    between the two that bracket it, over `budget`. Beyond them, a bound:
    dict(value, bound) with bound None, "at least" (the loss is below the baseline's
    at its largest budget: value = largest budget / budget) or "at most"."""
    pts = sorted((int(d), float(l)) for d, l in points)
    for (d1, l1), (d2, l2) in zip(pts, pts[1:]):
        if min(l1, l2) <= loss <= max(l1, l2) and l1 != l2:
            t = (l1 - loss) / (l1 - l2)
            return dict(value=math.exp(math.log(d1) + t * (math.log(d2) - math.log(d1)))
                        / budget, bound=None)
    if loss < min(l for _, l in pts):
        return dict(value=pts[-1][0] / budget, bound="at least")
    return dict(value=pts[0][0] / budget, bound="at most")


def edges(spec, point):
    """Messages for each swept axis whose best value is the first or last of its
    grid (sorted): the best may lie beyond it."""
    out = []
    for k in C.axes(spec):
        vals = spec[k]
        if len(vals) < 2:
            continue
        try:
            order = sorted(vals)
        except TypeError:
            order = list(vals)
        if point[k] == order[0] or point[k] == order[-1]:
            out.append("%s=%s is the %s of its grid %s: widen the grid" % (
                k, _num(point[k]), "smallest" if point[k] == order[0] else "largest",
                _num(vals)))
    return out


def analyse(cfg, runs):
    """The comparison from the config and the run records ({key: record}): the
    results.json structure."""
    names = list(cfg["optimizers"])
    budgets = cfg["budgets_tokens"]
    missing, optimizers = {}, {}
    descents = needed = None
    if cfg["search"] == "coordinate":  # only what the descents need is missing
        from .search import coordinate_state
        descents, need = coordinate_state(cfg, runs)
        needed = {r["key"] for r in need}
    for name in names:
        spec = cfg["optimizers"][name]
        expected = C.runs_of(cfg, name)
        pts = {}
        recs = []
        for (b, s, pj), key in sorted(expected.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            rec = runs.get(key)
            point = json.loads(pj)
            if rec is None:
                if needed is not None and key not in needed:
                    continue  # a point the descent has not asked for
                f = C.run_file(spec["optimizer"], b, s, key)
                if f in missing:  # a run several names share: listed once
                    missing[f]["names"].append(name)
                else:
                    missing[f] = dict(optimizer=name, names=[name], budget=b, seed=s,
                                      point=point, file=f)
                continue
            recs.append(rec)
            pts.setdefault((b, pj), {})[s] = rec
        best = {}
        for b in budgets:
            cands = []
            for (bb, pj), by_seed in pts.items():
                if bb != b or not by_seed or not all(_ok(r) for r in by_seed.values()):
                    continue
                cands.append((_mean([r["val_loss"] for r in by_seed.values()]), pj, by_seed))
            if not cands:
                continue
            val, pj, by_seed = min(cands, key=lambda c: c[0])
            point = json.loads(pj)
            entry = dict(point)
            entry.update(
                val_loss=val, seeds=sorted(by_seed),
                val_losses={str(s): r["val_loss"] for s, r in sorted(by_seed.items())},
                train_loss=_mean([r["train_loss"] for r in by_seed.values()]),
                tokens_per_s=_mean([r["tokens_per_s"] for r in by_seed.values()]),
                tokens_per_s_per_seed={str(s): r["tokens_per_s"] for s, r in
                                       sorted(by_seed.items())},
                step_ms=_mean([r.get("step_ms") for r in by_seed.values()]),
                state_bytes_per_rank=max(max(r.get("state_bytes_per_rank") or [0])
                                         for r in by_seed.values()),
                peak_mib_per_rank=max(max(r.get("peak_mib_per_rank") or [0])
                                      for r in by_seed.values()),
                point=point, edge=edges(spec, point),
                incomplete=len(by_seed) < len(cfg["seeds"]),
                machines=sorted({(r.get("machine") or {}).get("cpu", "?") for r in
                                 by_seed.values()}))
            best[str(b)] = entry
        finished = [r for r in recs if not r.get("error")]
        optimizers[name] = dict(
            optimizer=spec["optimizer"], best=best,
            state_bytes_per_rank=max([max(r.get("state_bytes_per_rank") or [0])
                                      for r in finished] or [0]),
            runs=[dict(file=r["file"], budget=r["budget"], seed=r["seed"], point=r["point"],
                       val_loss=r.get("val_loss"), train_loss=r.get("train_loss"),
                       tokens_per_s=r.get("tokens_per_s"), step_ms=r.get("step_ms"),
                       diverged=bool(r.get("diverged")), diverged_step=r.get("diverged_step"),
                       diverged_reason=r.get("diverged_reason"), error=r.get("error"),
                       state_bytes_per_rank=r.get("state_bytes_per_rank"),
                       peak_mib_per_rank=r.get("peak_mib_per_rank"))
                  for r in recs])
    base_name = cfg["baseline"]
    base = optimizers[base_name]["best"]
    law, law_error = None, None
    pts = [(int(b), e["val_loss"]) for b, e in base.items()]
    if len(pts) < 3:
        law_error = ("the baseline '%s' has best points at %d budget(s) (%s); the law needs 3 "
                     "or more" % (base_name, len(pts), ", ".join(str(b) for b, _ in pts) or
                                  "none"))
    else:
        try:
            law = fit_law([b for b, _ in pts], [l for _, l in pts])
        except ValueError as e:
            law_error = str(e)
    for name, o in optimizers.items():
        tok, wall, interp = {}, {}, {}
        for b, e in o["best"].items():
            if pts:
                interp[b] = interpolated_speedup(pts, e["val_loss"], int(b))
            be = base.get(b)
            if law is None or be is None:
                continue
            D = int(b)
            value = token_speedup(law, e["val_loss"], D, baseline_loss=be["val_loss"])
            seeds = [s for s in e["val_losses"] if s in be["val_losses"]]
            per = {s: token_speedup(law, e["val_losses"][s], D,
                                    baseline_loss=be["val_losses"][s]) for s in seeds}
            tok[b] = _interval(value, per)
            ratio = e["tokens_per_s"] / be["tokens_per_s"]
            wper = {s: per[s] * e["tokens_per_s_per_seed"][s] / be["tokens_per_s_per_seed"][s]
                    for s in seeds}
            wall[b] = _interval(value * ratio, wper)
            wall[b]["throughput_ratio"] = ratio
        o["token_speedup"] = tok
        o["wallclock_speedup"] = wall
        o["interpolated_speedup"] = interp
        if descents is not None:
            o["descent"] = {str(b): dict(ended=d["done"], point=d["point"],
                                         visited=len(d["visited"]))
                            for (n, b), d in descents.items() if n == name}
    machines = sorted({m for o in optimizers.values() for e in o["best"].values()
                       for m in e["machines"]})
    params = max([r.get("params") or 0 for r in runs.values()] or [0])
    caveat = ("scale: a model of %.2fM parameters, budgets of %s to %s tokens (%.2g to %.2g tokens "
              "per parameter; Chinchilla is about 20), %d seed%s%s. The published speedups "
              "(Muon, SOAP, Kron about 1.4x at 0.1B falling to 1.1x at 1.2B, 1-8x Chinchilla: "
              "Wen et al. 2509.02046; Muon about 1.4x, Shampoo about 1.3x from 190M to 1.4B: "
              "2512.05620) are for models and budgets hundreds to thousands of times larger; "
              "read these as what this protocol measures here, not as those numbers."
              % (params / 1e6, _tokens(budgets[0]), _tokens(budgets[-1]),
                 budgets[0] / params if params else float("nan"),
                 budgets[-1] / params if params else float("nan"), len(cfg["seeds"]),
                 "" if len(cfg["seeds"]) == 1 else "s",
                 ": no spread over seeds, so differences within the seed-to-seed noise (not "
                 "measured) mean nothing" if len(cfg["seeds"]) == 1 else ""))
    return dict(
        baseline=base_name,
        law=None if law is None else law.to_dict(),
        law_error=law_error,
        optimizers=optimizers,
        missing=list(missing.values()),
        machines=machines,
        interval="range over seeds of the paired per-seed speedups (seed s of the challenger "
                 "against seed s of the baseline, through the law fitted to the seed-averaged "
                 "best baseline points, re-centred at each budget through the baseline's loss); "
                 "not a confidence interval",
        seeds=cfg["seeds"], budgets_tokens=budgets, params=params, caveat=caveat)


def _sp(d):
    if not d:
        return "-"
    if d.get("value") is None:
        return "inf (beyond the law)"
    if d["low"] is None or d["low"] == d["high"]:
        return "%.3f" % d["value"]
    return "%.3f [%.3f, %.3f]" % (d["value"], d["low"], d["high"])


def table(res, cfg):
    """The terminal table's lines."""
    lines = []
    base = res["baseline"]
    law = res["law"]
    if law:
        lines.append("%s's law, fitted to its best points: L(D) = %.4f + %.4g * D^-%.4f"
                     % (base, law["beta"], law["alpha"], law["B"]))
        lines.append("  residuals (observed - law): " + ", ".join(
            "D=%d: %+.4f" % (d, r) for d, r in zip(law["budgets"], law["residuals"])))
        for note in law.get("notes") or []:
            lines.append("  WARNING: %s; the speedups below convert loss gaps into tokens at "
                         "this fit's average rate, not along a fitted power law" % note)
    else:
        lines.append("no law for %s: %s; no speedups" % (base, res["law_error"]))
    head = ("%-10s %-14s %-26s %-16s %-24s %-9s %-24s %9s %11s" % (
        "budget", "optimizer", "best point", "val loss (n)", "token speedup [range]", "interp.",
        "wall-clock speedup [range]", "tokens/s", "state/rank"))
    lines += ["", head, "-" * len(head)]
    notes = []
    for b in res["budgets_tokens"]:
        for name, o in res["optimizers"].items():
            e = o["best"].get(str(b))
            if e is None:
                lines.append("%-10d %-14s %s" % (b, name, "no finished point (missing or "
                                                 "diverged)"))
                continue
            tok = "1 (baseline)" if name == base and law else _sp(o["token_speedup"].get(str(b)))
            wall = "1 (baseline)" if name == base and law else _sp(
                o["wallclock_speedup"].get(str(b)))
            flag = " *" if e["edge"] or e["incomplete"] else ""
            ip = o.get("interpolated_speedup", {}).get(str(b))
            ip = "-" if not ip or name == base else "%s%.2f" % (
                {"at least": ">", "at most": "<"}.get(ip["bound"], ""), ip["value"])
            lines.append("%-10d %-14s %-26s %-16s %-24s %-9s %-24s %9.0f %7.2f MiB%s" % (
                b, name, _fmt_point(e["point"])[:26], "%.4f (%d)" % (e["val_loss"], len(e["seeds"])),
                tok, ip, wall, e["tokens_per_s"], e["state_bytes_per_rank"] / MiB, flag))
            for m in e["edge"]:
                notes.append("* %s at budget %d: %s" % (name, b, m))
            if e["incomplete"]:
                notes.append("* %s at budget %d: best point finished %d of %d seeds"
                             % (name, b, len(e["seeds"]), len(cfg["seeds"])))
        lines.append("")
    div, seen = [], {}
    for n, o in res["optimizers"].items():  # (a run several names share: once)
        for r in o["runs"]:
            if r["diverged"] or r["error"]:
                if r["file"] in seen:
                    seen[r["file"]][0] += "/" + n
                else:
                    seen[r["file"]] = [n, r]
                    div.append(seen[r["file"]])
    if div:
        lines.append("excluded from best (%d): " % len(div))
        for n, r in div:
            lines.append("  %s %s budget %d seed %d: %s" % (
                n, _fmt_point(r["point"]), r["budget"], r["seed"],
                ("diverged at step %s: %s" % (r["diverged_step"], r["diverged_reason"]))
                if r["diverged"] else "failed: %s" % r["error"]))
    lines += notes
    if res["missing"]:
        lines.append("MISSING %d run(s) (not in %s; train them with `run` on this config):"
                     % (len(res["missing"]), "runs/"))
        for m in res["missing"][:20]:
            lines.append("  %s %s budget %d seed %d: runs/%s" % (
                "/".join(m["names"]), _fmt_point(m["point"]), m["budget"], m["seed"], m["file"]))
        if len(res["missing"]) > 20:
            lines.append("  ... and %d more (results.json lists them all)"
                         % (len(res["missing"]) - 20))
    if len(res["machines"]) > 1:
        lines.append("WARNING: the best runs come from several CPUs/GPUs (%s): wall-clock "
                     "speedups compare machines, not optimizers" % "; ".join(res["machines"]))
    unended = [(n, b) for n, o in res["optimizers"].items()
               for b, d in (o.get("descent") or {}).items() if not d["ended"]]
    if unended:
        lines.append("coordinate descents not ended (their best is provisional): "
                     + ", ".join("%s at %s" % nb for nb in unended))
    lines.append("speedup intervals: " + res["interval"])
    lines.append("interp.: the budget at which %s's measured best points reach the loss, linear "
                 "in log budget between the two that bracket it, over the budget (no law; > and "
                 "<: beyond its largest or smallest budget)" % base)
    lines.append("caveat: " + res["caveat"])
    return lines


def plots(res, cfg, out):
    """loss_vs_tokens.png, speedup.png, lr_sensitivity.png in out; [] without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker  # noqa: F401
    except ImportError:
        return []
    paths = []
    names = list(res["optimizers"])
    colors = {n: "C%d" % i for i, n in enumerate(names)}
    budgets = res["budgets_tokens"]
    # Loss against tokens: the best point per budget (range over seeds), the law.
    fig, ax = plt.subplots(figsize=(7, 5))
    for n in names:
        best = res["optimizers"][n]["best"]
        bs = [b for b in budgets if str(b) in best]
        if not bs:
            continue
        ys = [best[str(b)]["val_loss"] for b in bs]
        lo = [y - min(best[str(b)]["val_losses"].values()) for b, y in zip(bs, ys)]
        hi = [max(best[str(b)]["val_losses"].values()) - y for b, y in zip(bs, ys)]
        ax.errorbar(bs, ys, yerr=[lo, hi], fmt="o-", color=colors[n], capsize=3, label=n)
    law = res["law"]
    if law:
        xs = [budgets[0] / 1.5 * (budgets[-1] * 2.25 / budgets[0]) ** (i / 100) for i in range(101)]
        ax.plot(xs, [law["beta"] + law["alpha"] * x ** -law["B"] for x in xs], "--",
                color=colors[res["baseline"]], alpha=0.7,
                label="%s's law: %.3f + %.3g D^-%.3f" % (res["baseline"], law["beta"],
                                                         law["alpha"], law["B"]))
    ax.set_xscale("log")
    ax.set_xlabel("budget (tokens)")
    ax.set_ylabel("validation loss at the end of the schedule (best point)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.set_title("best run per budget (bars: range over seeds)")
    fig.tight_layout()
    paths.append(os.path.join(out, "loss_vs_tokens.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    # Speedups with their ranges.
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    for k, (key, title) in enumerate((("token_speedup", "token speedup (D_eff / D)"),
                                      ("wallclock_speedup", "wall-clock speedup"))):
        ax = axes[k]
        ax.axhline(1.0, color="gray", lw=0.8)
        for i, n in enumerate(names):
            if n == res["baseline"]:
                continue
            sp = res["optimizers"][n][key]
            bs = [b for b in budgets if str(b) in sp and sp[str(b)]["value"] is not None]
            if not bs:
                continue
            shift = 1 + 0.03 * (i - len(names) / 2)  # side by side
            ys = [sp[str(b)]["value"] for b in bs]
            lo = [max(0.0, y - (sp[str(b)]["low"] if sp[str(b)]["low"] is not None else y))
                  for b, y in zip(bs, ys)]
            hi = [max(0.0, (sp[str(b)]["high"] if sp[str(b)]["high"] is not None else y) - y)
                  for b, y in zip(bs, ys)]
            ax.errorbar([b * shift for b in bs], ys, yerr=[lo, hi], fmt="o-", color=colors[n],
                        capsize=3, label=n)
        ax.set_xscale("log")
        ax.set_xlabel("budget (tokens)")
        ax.set_title("%s over %s (bars: range over seeds)" % (title, res["baseline"]))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(out, "speedup.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    # Loss against learning rate, per optimizer (best over the other axes).
    cols = min(3, len(names))
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.6 * rows), squeeze=False)
    for i, n in enumerate(names):
        ax = axes[i // cols][i % cols]
        o = res["optimizers"][n]
        top = []
        for j, b in enumerate(budgets):
            by_lr, bad = {}, set()
            groups = {}
            for r in o["runs"]:
                if r["budget"] != b:
                    continue
                groups.setdefault(json.dumps(r["point"], sort_keys=True), []).append(r)
            for pj, rs in groups.items():
                lr = json.loads(pj)["lr"]
                if any(r["diverged"] or r["error"] for r in rs):
                    bad.add(lr)
                    continue
                v = _mean([r["val_loss"] for r in rs])
                if v is not None and (lr not in by_lr or v < by_lr[lr]):
                    by_lr[lr] = v
            lrs = sorted(by_lr)
            if lrs:
                ax.plot(lrs, [by_lr[x] for x in lrs], "o-", color="C%d" % j, label="D=%d" % b)
                top.append(max(by_lr.values()))
            bad -= set(by_lr)
            if bad:
                ax.scatter(sorted(bad), [max(top or [0]) * 1.01] * len(bad), marker="x",
                           color="C%d" % j)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks(sorted({r["point"]["lr"] for r in o["runs"]}))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: "%g" % x))
        ax.tick_params(axis="x", labelsize=7)
        ax.set_title("%s (%s)" % (n, o["optimizer"]), fontsize=10)
        ax.set_xlabel("learning rate")
        ax.set_ylabel("validation loss")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for k in range(len(names), rows * cols):
        axes[k // cols][k % cols].axis("off")
    fig.suptitle("sensitivity to the learning rate (mean over seeds; x: diverged)")
    fig.tight_layout()
    paths.append(os.path.join(out, "lr_sensitivity.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


def report(out, echo=None, plot=True):
    """Reads DIR, prints the table, writes DIR/results.json (and the PNGs); returns
    the results."""
    if echo is None:
        from .sweep import say as echo
    path = os.path.join(out, "config.json")
    if not os.path.exists(path):
        raise SystemExit("report: %s has no config.json (made by `run`)" % out)
    cfg = C.load(path)
    res = analyse(cfg, _load_runs(out))
    for line in table(res, cfg):
        echo(line)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    echo("results: %s" % os.path.join(out, "results.json"))
    if plot:
        made = plots(res, cfg, out)
        echo("plots: %s" % (", ".join(made) if made else "none (matplotlib is not installed)"))
    return res
