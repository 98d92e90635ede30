"""rfsdp-compare / python -m rfsdp.compare: `run CONFIG --out DIR` and `report DIR`."""
import argparse
import sys


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="rfsdp-compare",
        description="Compare optimizers against a baseline (AdamW) the way the field now "
                    "accepts: per-optimizer sweeps at several budgets, end-of-schedule losses, "
                    "the baseline's loss-vs-budget law, token and wall-clock speedups, memory.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train the config's runs that DIR lacks, then report")
    r.add_argument("config", help="the comparison's JSON config")
    r.add_argument("--out", required=True, help="the folder of runs (shared by machines)")
    r.add_argument("--shard", default="1/1",
                   help="I/N: train every N-th run from the I-th (1-based), for N machines "
                        "sharing --out")
    r.add_argument("--no-report", action="store_true", help="train only")
    p = sub.add_parser("report", help="report on the runs in DIR")
    p.add_argument("dir")
    p.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    from .config import ConfigError
    try:
        if args.cmd == "run":
            from .sweep import run
            run(args.config, args.out, shard=args.shard, report=not args.no_report)
        else:
            from .analysis import report
            report(args.dir, plot=not args.no_plots)
    except ConfigError as e:
        print("rfsdp-compare: %s" % e, file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("rfsdp-compare: interrupted (finished runs are kept: run again to resume)",
              file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
