"""`run CONFIG --out DIR`: trains every run of the config that DIR does not hold yet
(this machine's share with --shard I/N), under torchrun on the config's ranks,
then reports. A run already in DIR/runs is never trained again, so an interrupted
sweep resumes and several machines can share one folder."""
import collections
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from . import config as C


def say(line):
    """The default echo: a line on stdout, flushed (progress lines reach a log file
    as they happen)."""
    print(line, flush=True)


def _done(out, run):
    return os.path.exists(os.path.join(out, "runs", run["file"]))


def _failure_record(cfg, run, reason):
    return dict(key=run["key"], file=run["file"], optimizer=run["optimizer"], names=run["names"],
                point=run["point"], budget=run["budget"], seed=run["seed"], steps=run["steps"],
                steps_done=0, tokens=0, error=reason, diverged=False, diverged_step=None,
                diverged_reason=None, val_loss=None, train_loss=None,
                config={k: cfg[k] for k in C.TRAINING_KEYS},
                machine=dict(host=socket.gethostname()),
                finished_at=time.strftime("%Y-%m-%dT%H:%M:%S"))


def launch(cfg, out, runs, offset, total, elapsed_before, tokens_before, echo=None,
           timeout_s=600):
    """One torchrun of the worker over `runs`; returns (exit code, last output lines)."""
    echo = echo or say
    fd, todo = tempfile.mkstemp(prefix="todo-", suffix=".json", dir=out)
    with os.fdopen(fd, "w") as f:
        json.dump(dict(config=cfg, runs=runs, offset=offset, total=total,
                       elapsed_before=elapsed_before, tokens_before=tokens_before,
                       timeout_s=timeout_s), f)
    env = dict(os.environ, OMP_NUM_THREADS=str(cfg["threads_per_rank"]))
    # The worker imports this package as the driver does (an editable or plain install).
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(cfg["ranks"]), "-m", "rfsdp.compare.worker", todo, out]
    tail = collections.deque(maxlen=40)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    try:
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            echo(line.rstrip("\n"))
        code = proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    finally:
        os.unlink(todo)
    return code, list(tail)


def _train(cfg, out, todo, echo, trainer=None, max_failures=None, t0=None):
    """Trains the runs in todo (those not yet in out), in order, under torchrun (or
    with trainer(cfg, out, runs): tests); a run whose worker died is recorded as
    failed and the rest go on. Returns how many failed."""
    todo = [r for r in todo if not _done(out, r)]
    if trainer is not None:
        trainer(cfg, out, todo)
        return 0
    t0 = time.time() if t0 is None else t0
    failures = tokens = offset = 0
    total = len(todo)
    per = cfg.get("runs_per_launch") or 0
    while todo:
        batch = todo[:per] if per else todo
        code, tail = launch(cfg, out, batch, offset, total, time.time() - t0, tokens, echo=echo)
        finished = [r for r in batch if _done(out, r)]
        tokens += sum(r["budget"] for r in finished)
        rest = [r for r in batch if not _done(out, r)]
        offset += len(batch) - len(rest)
        if code == 0 or not rest:
            if code != 0:
                echo("[compare] the worker exited with code %d after its last run" % code)
            elif rest:
                echo("[compare] the worker ended without %d of its runs (see the report's "
                     "missing runs)" % len(rest))
            todo = todo[len(batch):]
            continue
        todo = rest + todo[len(batch):]
        # The worker died in the first run it had not finished: recorded as failed.
        failures += 1
        bad = rest[0]
        reason = ("the worker exited with code %d while training this run: %s"
                  % (code, " | ".join(l for l in tail[-6:] if l.strip())[-1500:]))
        from .worker import write_json
        write_json(os.path.join(out, "runs", bad["file"]), _failure_record(cfg, bad, reason))
        echo("[compare] run %d of %d FAILED: %s" % (offset + 1, total, reason))
        offset += 1
        todo = todo[1:]  # (bad is todo[0])
        if max_failures is not None and failures >= max_failures:
            echo("[compare] %d failures: stopping (%d runs left untrained)" % (failures, len(todo)))
            break
    return failures


def run(config_path, out, shard="1/1", report=True, echo=None, max_failures=None,
        trainer=None):
    """Trains what DIR lacks of this machine's share of the config's runs (grid: every
    point; coordinate: what the descents need, round after round); returns the
    report's results (or None with report=False)."""
    echo = echo or say
    cfg = C.load(config_path)
    index, count = C.parse_shard(shard)
    os.makedirs(os.path.join(out, "runs"), exist_ok=True)
    old = os.path.join(out, "config.json")
    if os.path.exists(old):
        with open(old) as f:
            prev = json.load(f)
        if prev != cfg:
            echo("[compare] %s held another config: replaced (runs are keyed by what trains "
                 "them, so those still asked for are kept)" % old)
    C.save(cfg, out)
    t0 = time.time()
    if cfg["search"] == "grid":
        runs = C.expand(cfg)
        mine = C.shard(runs, index, count)
        todo = [r for r in mine if not _done(out, r)]
        echo("[compare] %d runs in the sweep%s; %d already in %s; %d to train"
             % (len(runs), " (%d in shard %s)" % (len(mine), shard) if count > 1 else "",
                len(mine) - len(todo), os.path.join(out, "runs"), len(todo)))
        _train(cfg, out, todo, echo, trainer, max_failures, t0)
    else:
        from .analysis import _load_runs
        from .search import coordinate_state
        rounds = 0
        while True:
            state, need = coordinate_state(cfg, _load_runs(out), index, count)
            ended = sum(1 for d in state.values() if d["done"])
            if not need:
                echo("[compare] coordinate descent: %d descents%s ended after %d round(s) here"
                     % (len(state), " (shard %s)" % shard if count > 1 else "", rounds))
                break
            rounds += 1
            echo("[compare] coordinate descent, round %d: %d of %d descents%s ended; %d runs "
                 "to train" % (rounds, ended, len(state),
                               " (shard %s)" % shard if count > 1 else "", len(need)))
            before = len(_load_runs(out))
            _train(cfg, out, need, echo, trainer, max_failures, t0)
            if len(_load_runs(out)) == before:
                echo("[compare] coordinate descent: a round trained nothing; stopping")
                break
    echo("[compare] trained in %s" % _fmt(time.time() - t0))
    if not report:
        return None
    from .analysis import report as make_report
    return make_report(out, echo=echo)


def _fmt(s):
    s = int(round(s))
    return "%dh%02dm%02ds" % (s // 3600, s % 3600 // 60, s % 60) if s >= 3600 else \
        "%dm%02ds" % (s // 60, s % 60)
