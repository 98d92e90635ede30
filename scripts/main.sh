#!/usr/bin/env bash
# The main job: AdamW, AdamW8bit and Muon compared the way the field now accepts
# (rfsdp.compare): the main job's GPT (width 128, 2 layers, 0.47M parameters) on
# Debian's fortunes text, each optimizer at 3 learning rates x 3 budgets (128K,
# 256K, 512K tokens, each its own WSD schedule) x 1 seed, every point a real run
# under torchrun on 2 processes, fully sharded with rfsdp; then AdamW's
# loss-vs-budget law, the token and wall-clock speedups, the state bytes per rank
# and the plots (5 minutes on 2 cores of an AMD EPYC, family 26 model 2; longer on
# older CPUs); then the planner report for the model zoo. Set-up as
# scripts/setup.sh, plus fortunes.
# Extra arguments go to `rfsdp-compare run` (e.g. --shard 1/2). The full sweep
# (6 optimizers, 2 seeds): python -m rfsdp.compare run examples/compare_sweep.json --out DIR
# (README.md); the one-run-per-optimizer job: examples/train_gpt.py --compare.
set -euo pipefail
cd "$(dirname "$0")/.."
RFSDP_EXTRA_PACKAGES="fortunes" bash scripts/setup.sh
BUILD_DIR=${RFSDP_BUILD_DIR:-build}
VENV=${RFSDP_VENV:-$HOME/.cache/rfsdp/venv}
OUT="$BUILD_DIR/compare_main"
rm -rf "$OUT"  # the main job trains afresh (rfsdp-compare itself resumes a folder it finds)
"$VENV/bin/python" -m rfsdp.compare run examples/compare_main.json --out "$OUT" "$@"
"$BUILD_DIR/bench/bench_planner" --world-sizes 8,1024,16384
