#!/usr/bin/env bash
# Run HERE (a CPU machine with this project's set-up) before scripts/gpu_check.sh
# on the GPU machine, which reaches no registry: gathers into .gpu_deps (ignored
# by git; name it in the device tool's carry) what the build there lacks and
# Debian gives here: GoogleTest's sources, gloo's headers (torch's c10d Gloo
# header includes them) and nlohmann-json's headers with its CMake package.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null  # the Debian packages named below
D=.gpu_deps
rm -rf "$D"
mkdir -p "$D/usr/include" "$D/usr/share/cmake"
cp -r /usr/src/googletest "$D/googletest"
cp -r /usr/include/gloo /usr/include/nlohmann "$D/usr/include/"
cp -r /usr/share/cmake/nlohmann_json "$D/usr/share/cmake/"
du -sh "$D"
