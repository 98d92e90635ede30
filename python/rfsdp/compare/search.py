"""Coordinate descent over an optimizer's grid ("search": "coordinate"), as Wen et
al. tune: from a start point, sweep one axis at a time with the others held, move
to the best value of that axis, and go round the axes until a whole round moves
nothing. Each (optimizer, budget) is its own descent; a point's score is its
validation loss averaged over the seeds (inf when a seed diverged or failed), so
every step of a descent waits for all of its seeds. Ties keep the current point,
and every move lowers the score, so a descent ends, at a point no better than any
it visited.

coordinate_state(cfg, runs) -> per (name, budget): the current point, whether the
descent ended, and the runs it needs next (not yet in `runs`)."""
import json
import math

from . import config as C


def start_point(spec):
    """The entry's "start" point, else the middle value of each axis (the lower
    middle for an even count)."""
    given = spec.get("start") or {}
    return {k: given.get(k, spec[k][(len(spec[k]) - 1) // 2]) for k in C.axes(spec)}


def _score(cfg, kind, point, budget, runs):
    """(mean validation loss or inf, [runs still missing])."""
    vals, need = [], []
    for seed in cfg["seeds"]:
        key = C.run_key(cfg, kind, point, budget, seed)
        rec = runs.get(key)
        if rec is None:
            need.append(dict(key=key, file=C.run_file(kind, budget, seed, key), optimizer=kind,
                             point=dict(point), budget=budget, seed=seed,
                             steps=C.steps(cfg, budget)))
            continue
        ok = (not rec.get("error") and not rec.get("diverged") and rec.get("val_loss") is not None
              and math.isfinite(rec["val_loss"]))
        vals.append(rec["val_loss"] if ok else math.inf)
    if need:
        return None, need
    return sum(vals) / len(vals), []


def descend(cfg, name, budget, runs):
    """One descent: dict(point, done, need, visited)."""
    spec = cfg["optimizers"][name]
    kind = spec["optimizer"]
    cur = start_point(spec)
    visited = []
    swept = [k for k in C.axes(spec) if len(spec[k]) > 1]
    s, need = _score(cfg, kind, cur, budget, runs)
    visited.append(dict(cur))
    if need:
        return dict(point=cur, done=False, need=need, visited=visited)
    for _ in range(10000):  # (a descent ends long before: each move lowers the score)
        moved = False
        for axis in swept:
            line = [dict(cur, **{axis: v}) for v in spec[axis]]
            scored, need = [], []
            for p in line:
                ps, pn = _score(cfg, kind, p, budget, runs)
                need += pn
                if p not in visited:
                    visited.append(p)
                scored.append((ps, p))
            if need:
                return dict(point=cur, done=False, need=need, visited=visited)
            best_s, best_p = min(scored, key=lambda t: t[0])
            if best_s < s:
                cur, s, moved = best_p, best_s, True
        if not moved:
            return dict(point=cur, done=True, need=[], visited=visited)
    raise RuntimeError("coordinate descent of %s at %d did not end" % (name, budget))


def searches(cfg):
    """Every (name, budget) descent, in a fixed order (shards take every N-th)."""
    return [(n, b) for b in cfg["budgets_tokens"] for n in cfg["optimizers"]]


def coordinate_state(cfg, runs, index=0, count=1):
    """{(name, budget): descend(...)} for this shard's descents, and the runs they
    need next (deduplicated: names sharing a kind and point share the run)."""
    state, need, seen = {}, [], {}
    for i, (name, budget) in enumerate(searches(cfg)):
        if i % count != index:
            continue
        d = descend(cfg, name, budget, runs)
        state[(name, budget)] = d
        for r in d["need"]:
            if r["key"] in seen:
                if name not in seen[r["key"]]["names"]:
                    seen[r["key"]]["names"].append(name)
                continue
            r = dict(r, names=[name])
            seen[r["key"]] = r
            need.append(r)
    return state, need


def canon(point):
    return json.dumps(point, sort_keys=True, separators=(",", ":"))
