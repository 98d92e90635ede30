#!/usr/bin/env bash
# Installs the C++ package from BUILD_DIR into a temporary prefix, builds
# examples/cpp against it out of tree (as a user would), and checks its losses
# on 2 ranks against the Python path (check_example.py).
# usage: run_example.sh BUILD_DIR PYTHON
set -euo pipefail
build=$1
python=$2
here="$(cd "$(dirname "$0")" && pwd)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" --component cpp > /dev/null
launcher=()
if command -v ccache > /dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
cmake -S "$here/../../examples/cpp" -B "$tmp/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$tmp/prefix" "${launcher[@]}" > "$tmp/configure.log" 2>&1 \
  || { cat "$tmp/configure.log"; exit 1; }
cmake --build "$tmp/build" > "$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; exit 1; }
"$python" "$here/check_example.py" "$tmp/build/train_mlp" --steps 40
