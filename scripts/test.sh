#!/usr/bin/env bash
# Every test: the C++ suite (GoogleTest through ctest), then the Python suite (pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD_DIR=${RFSDP_BUILD_DIR:-build}
ctest --test-dir "$BUILD_DIR" --output-on-failure -j 2
RFSDP_BUILD_DIR="$BUILD_DIR" /usr/bin/python3 -m pytest -q tests/python
