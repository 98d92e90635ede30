"""rfsdp.compare: optimizer comparisons the way the field now accepts them
(Wen et al., "Fantastic Pretraining Optimizers and Where to Find Them", arXiv
2509.02046): every optimizer swept over its own grid at several token budgets, each
run a real sharded training run whose schedule ends at its budget, scored by its
end-of-schedule loss on fixed held-out tokens; the baseline's (AdamW's) law
L(D) = beta + alpha * D^-B fitted to its best points; per challenger and budget
the token speedup D_eff / D and the wall-clock speedup, beside optimizer-state
bytes per rank.

    python -m rfsdp.compare run CONFIG --out DIR [--shard I/N]   # or rfsdp-compare
    python -m rfsdp.compare report DIR

One JSON file per finished run in DIR/runs (a run already there is not trained
again: a sweep resumes, and machines sharing DIR split it with --shard I/N);
DIR/results.json, DIR/*.png. The config's keys: rfsdp.compare.config.

Python: fit_law(budgets, losses) -> Law (alpha, B, beta); token_speedup(law, loss,
budget[, baseline_loss]) -> D_eff / budget; wallclock_speedup(...); run(config,
out, shard="1/1"); report(out). Importing this needs no matplotlib (the plots
import it when drawn)."""
from .law import Law, fit_law, token_speedup, wallclock_speedup


def run(config, out, shard="1/1", report=True, echo=None):
    """Trains what `out` lacks of the config's runs (this shard's), then reports."""
    from .sweep import run as _run
    return _run(config, out, shard=shard, report=report, echo=echo)


def report(out, echo=None, plot=True):
    """The report of the runs in `out`: table, results.json, plots; returns the results."""
    from .analysis import report as _report
    return _report(out, echo=echo, plot=plot)


__all__ = ["Law", "fit_law", "token_speedup", "wallclock_speedup", "run", "report"]
