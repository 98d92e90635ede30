#!/usr/bin/env bash
# The main job. Until the training example lands, it prints the planner report
# (bench_planner) for the model zoo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
"${RFSDP_BUILD_DIR:-build}/bench/bench_planner" "$@"
