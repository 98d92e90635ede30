#!/usr/bin/env bash
# The main job: a small GPT (3.3M parameters) trained on Debian's fortunes text
# with torchrun on 2 processes, fully sharded with rfsdp, comparing AdamW,
# AdamW8bit, Muon, Shampoo and SOAP on the same data and seed (about 6 minutes
# on 2 cores); then the planner report for the model zoo. Set-up as scripts/setup.sh, plus fortunes.
# Extra arguments go to examples/train_gpt.py (e.g. --steps 20).
set -euo pipefail
cd "$(dirname "$0")/.."
RFSDP_EXTRA_PACKAGES="fortunes" bash scripts/setup.sh
BUILD_DIR=${RFSDP_BUILD_DIR:-build}
VENV=${RFSDP_VENV:-$HOME/.cache/rfsdp/venv}
"$VENV/bin/torchrun" --standalone --nproc_per_node 2 \
  examples/train_gpt.py --compare --plot "$BUILD_DIR/loss_curves.png" "$@"
"$BUILD_DIR/bench/bench_planner" --world-sizes 8,1024,16384
