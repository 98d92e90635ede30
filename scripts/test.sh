#!/usr/bin/env bash
# Every test: set-up and build (scripts/setup.sh; installs nothing when nothing
# is missing), then the C++ suite (GoogleTest through ctest) and the Python suite
# (pytest) in the project's environment.
#   bash scripts/test.sh                      # both suites
#   bash scripts/test.sh cpp -R Muon          # ctest only, arguments forwarded
#   bash scripts/test.sh py -k fsdp2 -x       # pytest only, arguments forwarded
#   bash scripts/test.sh py tests/python/test_habits.py   # those files only
set -euo pipefail
cd "$(dirname "$0")/.."
suite=all
if [ $# -gt 0 ]; then
  case "$1" in
    cpp|py) suite=$1; shift ;;
    *) echo "usage: bash scripts/test.sh [cpp|py [arguments for ctest or pytest]]" >&2; exit 2 ;;
  esac
fi
# fortunes: real text for the main job's model in the tests
RFSDP_EXTRA_PACKAGES="fortunes ${RFSDP_EXTRA_PACKAGES:-}" bash scripts/setup.sh
BUILD_DIR=${RFSDP_BUILD_DIR:-build}
PY=${RFSDP_VENV:-$HOME/.cache/rfsdp/venv}/bin/python
if [ "$suite" != py ]; then
  ctest --test-dir "$BUILD_DIR" --output-on-failure -j 2 "$@"
fi
if [ "$suite" != cpp ]; then
  # Every Python test, or the files / test ids given (bash scripts/test.sh py tests/python/x.py).
  targets=(tests/python)
  for a in "$@"; do
    case "$a" in tests/*|*.py|*::*) targets=() ;; esac
  done
  # (--durations: the 20 slowest tests, to keep the suite inside its time)
  RFSDP_BUILD_DIR="$BUILD_DIR" "$PY" -m pytest -q --durations=20 "${targets[@]}" "$@"
fi
