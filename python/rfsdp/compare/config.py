"""A comparison's configuration (JSON), checked; the runs it asks for; schedules.

{"model": {"kind": "gpt", "width": W, "layers": L, "heads": H, "ctx": T}
          or {"kind": "callable", "factory": "pkg.mod:fn", "ctx": T},
 "data": "fortunes" or a text file, "ranks": N, "batch_tokens": global tokens per step,
 "budgets_tokens": [D1, D2, D3, ...], "seeds": [...], "baseline": NAME,
 "optimizers": {NAME: {"optimizer": "adamw" | "muon:int8" | ..., "lr": [...],
                       "weight_decay": [...], any other keyword: [...]}},
 "schedule": {"kind": "wsd" | "cosine", "warmup_fraction": f, "decay_fraction": f,
              "min_lr_fraction": 0.0}}
Optional: "val_tokens" (65536: the held-out tokens every run is scored on),
"device" ("cpu" | "cuda"), "threads_per_rank" (1), "clip" (1.0; 0: none),
"divergence_window" (10), "search" ("grid": every point; "coordinate": coordinate
descent from each entry's "start" point, rfsdp.compare.search), "runs_per_launch"
(runs per torchrun; 0: all of them in one)."""
import hashlib
import itertools
import json
import math
import os

from .optimizers import allowed_keywords, parse_name

REQUIRED = ["model", "data", "ranks", "batch_tokens", "budgets_tokens", "seeds", "baseline",
            "optimizers", "schedule"]
OPTIONAL = dict(val_tokens=65536, device="cpu", threads_per_rank=1, clip=1.0,
                divergence_window=10, search="grid")
# What a run's key holds besides its optimizer point: a run is the same run (and
# trained once) whenever these, the optimizer kind, its hyperparameters, the budget
# and the seed are, whatever name the optimizer has in the config.
TRAINING_KEYS = ["model", "data", "ranks", "batch_tokens", "schedule", "val_tokens", "device",
                 "clip", "divergence_window"]
PROTOCOL = 1  # bump when a run's meaning changes (its key changes with it)


class ConfigError(ValueError):
    pass


def load(path_or_dict):
    """The config, checked, with the optional keys filled in."""
    if isinstance(path_or_dict, dict):
        cfg = json.loads(json.dumps(path_or_dict))
    else:
        with open(path_or_dict) as f:
            cfg = json.load(f)
    return check(cfg)


def _positive_int(cfg, key):
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError("config: %r must be a positive integer, got %r" % (key, v))


def check(cfg):
    missing = [k for k in REQUIRED if k not in cfg]
    if missing:
        raise ConfigError("config: missing %s (required: %s)" % (", ".join(missing),
                                                                  ", ".join(REQUIRED)))
    for k, v in OPTIONAL.items():
        cfg.setdefault(k, v)
    cfg.setdefault("runs_per_launch", 0)
    if isinstance(cfg["runs_per_launch"], bool) or not isinstance(cfg["runs_per_launch"], int) \
            or cfg["runs_per_launch"] < 0:
        raise ConfigError("config: runs_per_launch must be an integer >= 0 (0: every run in "
                          "one launch), got %r" % (cfg["runs_per_launch"],))
    model = cfg["model"]
    kind = model.get("kind") if isinstance(model, dict) else None
    if kind == "gpt":
        need = [k for k in ("width", "layers", "heads", "ctx") if k not in model]
        if need:
            raise ConfigError("config: model kind 'gpt' needs %s" % ", ".join(need))
        if model["width"] % model["heads"]:
            raise ConfigError("config: model width %d is not a multiple of heads %d"
                              % (model["width"], model["heads"]))
    elif kind == "callable":
        if ":" not in str(model.get("factory", "")) or "ctx" not in model:
            raise ConfigError("config: model kind 'callable' needs \"factory\": \"pkg.mod:fn\" "
                              "and \"ctx\"")
    else:
        raise ConfigError("config: model kind must be 'gpt' or 'callable', got %r" % (kind,))
    for k in ("ranks", "batch_tokens", "val_tokens", "threads_per_rank", "divergence_window"):
        _positive_int(cfg, k)
    ctx = model["ctx"]
    if cfg["batch_tokens"] % (cfg["ranks"] * ctx):
        raise ConfigError("config: batch_tokens %d is not a multiple of ranks x ctx = %d x %d"
                          % (cfg["batch_tokens"], cfg["ranks"], ctx))
    budgets = cfg["budgets_tokens"]
    if not budgets or any(not isinstance(b, int) or b < 1 for b in budgets):
        raise ConfigError("config: budgets_tokens must be positive integers, got %r" % (budgets,))
    bad = [b for b in budgets if b % cfg["batch_tokens"]]
    if bad:
        raise ConfigError("config: budgets %s are not multiples of batch_tokens %d"
                          % (bad, cfg["batch_tokens"]))
    if len(set(budgets)) != len(budgets):
        raise ConfigError("config: budgets_tokens repeats a budget: %r" % (budgets,))
    cfg["budgets_tokens"] = sorted(budgets)
    seeds = cfg["seeds"]
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) for s in seeds) \
            or len(set(seeds)) != len(seeds):
        raise ConfigError("config: seeds must be distinct integers, got %r" % (seeds,))
    if cfg["search"] not in ("grid", "coordinate"):
        raise ConfigError("config: search must be 'grid' or 'coordinate', got %r"
                          % (cfg["search"],))
    if cfg["device"] not in ("cpu", "cuda"):
        raise ConfigError("config: device must be 'cpu' or 'cuda', got %r" % (cfg["device"],))
    sched = cfg["schedule"]
    if sched.get("kind") not in ("wsd", "cosine"):
        raise ConfigError("config: schedule kind must be 'wsd' or 'cosine', got %r"
                          % (sched.get("kind"),))
    sched.setdefault("warmup_fraction", 0.1)
    sched.setdefault("decay_fraction", 0.2 if sched["kind"] == "wsd" else 0.0)
    sched.setdefault("min_lr_fraction", 0.0)
    w, d = sched["warmup_fraction"], sched["decay_fraction"]
    if not (0 <= w < 1 and 0 <= d <= 1 and w + d <= 1):
        raise ConfigError("config: schedule fractions must satisfy 0 <= warmup < 1, "
                          "0 <= decay <= 1, warmup + decay <= 1 (got %r, %r)" % (w, d))
    opts = cfg["optimizers"]
    if not isinstance(opts, dict) or not opts:
        raise ConfigError("config: optimizers must name at least one optimizer")
    for name, spec in opts.items():
        if "optimizer" not in spec or "lr" not in spec:
            raise ConfigError("config: optimizer %r needs \"optimizer\" and \"lr\"" % name)
        try:
            parse_name(spec["optimizer"])
        except ValueError as e:
            raise ConfigError("config: optimizer %r: %s" % (name, e))
        allowed = allowed_keywords(spec["optimizer"])
        unknown = [k for k in spec if k not in ("optimizer", "start") and k not in allowed]
        if unknown:
            raise ConfigError("config: optimizer %r (%s) takes no %s (it takes: %s)"
                              % (name, spec["optimizer"], ", ".join(map(repr, unknown)),
                                 ", ".join(allowed)))
        start = spec.get("start", {})
        if not isinstance(start, dict) or any(k not in spec or k in ("optimizer", "start")
                                              or v not in spec[k] for k, v in start.items()):
            raise ConfigError("config: optimizer %r: \"start\" must map swept keywords to "
                              "values of their grids, got %r" % (name, start))
        for k, v in spec.items():
            if k in ("optimizer", "start"):
                continue
            if not isinstance(v, list) or not v:
                raise ConfigError("config: optimizer %r: %r must be a non-empty list of values "
                                  "(the grid; a tuple-valued keyword is a list of lists)"
                                  % (name, k))
            if len({json.dumps(x) for x in v}) != len(v):
                raise ConfigError("config: optimizer %r: %r repeats a value: %r" % (name, k, v))
        if any(not isinstance(x, (int, float)) or x <= 0 for x in spec["lr"]):
            raise ConfigError("config: optimizer %r: lr values must be positive numbers" % name)
    if cfg["baseline"] not in opts:
        raise ConfigError("config: baseline %r is not one of the optimizers (%s)"
                          % (cfg["baseline"], ", ".join(opts)))
    check_fair(cfg)
    return cfg


def axes(spec):
    """The swept hyperparameters of an optimizer's entry, in a fixed order: lr, then
    weight_decay, then the rest by name."""
    keys = [k for k in spec if k not in ("optimizer", "start")]
    return sorted(keys, key=lambda k: (k != "lr", k != "weight_decay", k))


def grid(spec):
    """Every point of the entry's grid: dicts {keyword: value}."""
    keys = axes(spec)
    return [dict(zip(keys, vals)) for vals in itertools.product(*(spec[k] for k in keys))]


def describe_grid(name, spec):
    keys = axes(spec)
    return "'%s' (%s): %d point%s (%s)" % (
        name, spec["optimizer"], len(grid(spec)), "" if len(grid(spec)) == 1 else "s",
        " x ".join("%s %d" % (k, len(spec[k])) for k in keys))


def check_fair(cfg):
    """The baseline is swept at least as widely as every challenger: at least as many
    grid points, and at least as many learning rates over at least as wide a span
    (largest / smallest). Refuses otherwise, naming the grids."""
    base = cfg["optimizers"][cfg["baseline"]]

    def span(v):
        return max(v) / min(v)
    unfair = []
    for name, spec in cfg["optimizers"].items():
        if name == cfg["baseline"]:
            continue
        if (len(grid(base)) < len(grid(spec)) or len(base["lr"]) < len(spec["lr"])
                or span(base["lr"]) < span(spec["lr"]) * (1 - 1e-9)):
            unfair.append(name)
    if unfair:
        raise ConfigError(
            "config: the baseline must be swept at least as widely as every challenger (as "
            "many grid points, as many learning rates over as wide a span), or the comparison "
            "favours the challenger: baseline %s (lr span %.3gx); %s. Widen the baseline's grid"
            % (describe_grid(cfg["baseline"], base), span(base["lr"]),
               "; ".join("%s (lr span %.3gx)" % (describe_grid(n, cfg["optimizers"][n]),
                                                  span(cfg["optimizers"][n]["lr"]))
                         for n in unfair)))


def steps(cfg, budget):
    return budget // cfg["batch_tokens"]


def lr_factor(sched, step, total):
    """The schedule's multiplier of the peak learning rate for step `step` (0-based)
    of `total`, ending at the budget: WSD (linear warmup, stable, linear decay to
    min_lr_fraction over the last decay_fraction) or cosine (linear warmup, then a
    cosine to min_lr_fraction)."""
    warm = max(1, int(round(sched["warmup_fraction"] * total))) if sched["warmup_fraction"] else 0
    floor = sched.get("min_lr_fraction", 0.0)
    if step < warm:
        return (step + 1) / warm
    if sched["kind"] == "wsd":
        decay = int(round(sched["decay_fraction"] * total))
        start = total - decay
        if decay == 0 or step < start:
            return 1.0
        return floor + (1 - floor) * (total - step) / decay
    t = (step - warm) / max(1, total - warm)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))


def _canon(x):
    return json.dumps(x, sort_keys=True, separators=(",", ":"))


def run_key(cfg, kind, point, budget, seed):
    """What determines a run's training, hashed: the same for the same optimizer kind
    and point under any name, so that name trains nothing twice."""
    what = dict(protocol=PROTOCOL, optimizer=kind, point=point, budget=budget, seed=seed,
                **{k: cfg[k] for k in TRAINING_KEYS})
    return hashlib.sha1(_canon(what).encode()).hexdigest()[:12]


def run_file(kind, budget, seed, key):
    return "%s-D%d-s%d-%s.json" % (kind.replace(":", "_"), budget, seed, key)


def expand(cfg):
    """Every run the config asks for, in the order they train: budgets small to
    large, then seeds, then grid points, optimizers interleaved (so that a machine's
    drift touches them alike). Runs that several names share appear once, with
    every name. Each: dict(key, file, optimizer (kind), names, point, budget, seed,
    steps)."""
    out, seen = [], {}
    order = list(cfg["optimizers"])
    grids = {n: grid(cfg["optimizers"][n]) for n in order}
    for budget in cfg["budgets_tokens"]:
        for seed in cfg["seeds"]:
            for i in range(max(len(g) for g in grids.values())):
                for name in order:
                    if i >= len(grids[name]):
                        continue
                    kind = cfg["optimizers"][name]["optimizer"]
                    point = grids[name][i]
                    key = run_key(cfg, kind, point, budget, seed)
                    if key in seen:
                        if name not in seen[key]["names"]:
                            seen[key]["names"].append(name)
                        continue
                    run = dict(key=key, file=run_file(kind, budget, seed, key), optimizer=kind,
                               names=[name], point=point, budget=budget, seed=seed,
                               steps=steps(cfg, budget))
                    seen[key] = run
                    out.append(run)
    return out


def runs_of(cfg, name):
    """{(budget, seed, point as canonical JSON): run key} for optimizer `name`."""
    kind = cfg["optimizers"][name]["optimizer"]
    return {(b, s, _canon(p)): run_key(cfg, kind, p, b, s)
            for b in cfg["budgets_tokens"] for s in cfg["seeds"]
            for p in grid(cfg["optimizers"][name])}


def parse_shard(text):
    """'I/N' (1-based) -> (I - 1, N)."""
    try:
        i, n = (int(x) for x in str(text).split("/"))
    except ValueError:
        raise ConfigError("--shard must be I/N (1 <= I <= N), got %r" % (text,))
    if not 1 <= i <= n:
        raise ConfigError("--shard must be I/N (1 <= I <= N), got %r" % (text,))
    return i - 1, n


def shard(runs, index, count):
    """Every count-th run from index (0-based): the runs one machine of count trains."""
    return runs[index::count]


def save(cfg, folder):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "config.json")
    tmp = path + ".tmp.%d" % os.getpid()
    with open(tmp, "w") as f:
        json.dump(cfg, f, indent=1)
    os.replace(tmp, path)
    return path
