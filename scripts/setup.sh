#!/usr/bin/env bash
# Installs the Debian packages the project needs (only the missing ones), then
# configures (once) and builds (incrementally) into ${RFSDP_BUILD_DIR:-build}.
set -euo pipefail
cd "$(dirname "$0")/.."

# libopenblas0-openmp: Debian's torch calls the system BLAS, which is otherwise the
# netlib reference (about 3 GFLOP/s for fp32 matmul here, against 55-80 with
# OpenBLAS); the OpenMP build follows torch.set_num_threads.
PACKAGES=(g++ cmake ninja-build ccache libtorch-dev python3-torch python3-dev pybind11-dev
          libgtest-dev nlohmann-json3-dev python3-pytest libgloo-dev libopenblas0-openmp)
# Callers may ask for more (the main job needs fortunes and matplotlib).
read -r -a extra <<< "${RFSDP_EXTRA_PACKAGES:-}"
PACKAGES+=("${extra[@]}")
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

BUILD_DIR=${RFSDP_BUILD_DIR:-build}
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release
fi
cmake --build "$BUILD_DIR"
