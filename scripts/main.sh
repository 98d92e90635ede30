#!/usr/bin/env bash
# The main job: a small GPT trained on Debian's fortunes text with torchrun on 2
# processes, fully sharded with rfsdp, comparing AdamW, AdamW8bit and Muon (about
# 5 minutes on 2 cores); then the planner report for the model zoo.
# Extra arguments go to examples/train_gpt.py (e.g. --steps 20).
set -euo pipefail
cd "$(dirname "$0")/.."
RFSDP_EXTRA_PACKAGES="fortunes" bash scripts/setup.sh
VENV=${RFSDP_VENV:-$HOME/.cache/rfsdp/venv}
"$VENV/bin/torchrun" --standalone --nproc_per_node 2 \
  examples/train_gpt.py --compare --plot build/loss_curves.png "$@"
"${RFSDP_BUILD_DIR:-build}/bench/bench_planner" --world-sizes 8,1024
