#!/usr/bin/env bash
# Installs the C++ package from BUILD_DIR into a temporary prefix, builds the
# CMake project PROJECT_DIR out of tree against it (find_package(RaggedFSDP)),
# as a user would, then runs COMMAND with @BIN@ replaced by that build folder.
# usage: run.sh BUILD_DIR PROJECT_DIR COMMAND...
set -euo pipefail
build=$1
project=$2
shift 2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" --component cpp > /dev/null
launcher=()
if command -v ccache > /dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
cmake -S "$project" -B "$tmp/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$tmp/prefix" "${launcher[@]}" > "$tmp/configure.log" 2>&1 \
  || { cat "$tmp/configure.log"; exit 1; }
cmake --build "$tmp/build" > "$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; exit 1; }
"${@//@BIN@/$tmp/build}"
