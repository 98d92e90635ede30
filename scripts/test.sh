#!/usr/bin/env bash
# Every test: set-up and build (scripts/setup.sh), then the C++ suite (GoogleTest
# through ctest) and the Python suite (pytest) in the project's environment.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD_DIR=${RFSDP_BUILD_DIR:-build}
PY=${RFSDP_VENV:-$HOME/.cache/rfsdp/venv}/bin/python
ctest --test-dir "$BUILD_DIR" --output-on-failure -j 2
RFSDP_BUILD_DIR="$BUILD_DIR" "$PY" -m pytest -q tests/python
