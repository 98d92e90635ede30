#!/usr/bin/env bash
# The main job: a small GPT trained on Debian's fortunes text with torchrun on 2
# processes, fully sharded with rfsdp, comparing AdamW and AdamW8bit (about 5
# minutes on 2 cores); then the planner report for the model zoo.
# Extra arguments go to examples/train_gpt.py (e.g. --steps 20).
set -euo pipefail
cd "$(dirname "$0")/.."
RFSDP_EXTRA_PACKAGES="fortunes python3-matplotlib" bash scripts/setup.sh
# --redirects 1 --tee 1: Debian's torchrun (torch 1.13) breaks on Python 3.11 with its
# default output settings; this sends stdout through a log and back.
/usr/bin/torchrun --standalone --nproc_per_node 2 --redirects 1 --tee 1 \
  examples/train_gpt.py --compare --plot build/loss_curves.png "$@"
"${RFSDP_BUILD_DIR:-build}/bench/bench_planner" --world-sizes 8,1024
