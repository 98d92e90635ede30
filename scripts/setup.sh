#!/usr/bin/env bash
# Set-up and incremental build, idempotent (a second run installs nothing):
#  1. the Debian packages the build needs (only the missing ones; apt-get);
#  2. the project's virtual environment, ${RFSDP_VENV:-~/.cache/rfsdp/venv}, with
#     scripts/requirements.txt (torch 2.11.0 from PyPI; pip's cache is kept);
#  3. CMake + Ninja + ccache into ${RFSDP_BUILD_DIR:-build}: the C++ libraries,
#     rfsdp-plan, tests, benches and the rfsdp._C extension (written next to the
#     package sources), rebuilding only what is stale;
#  4. the project installed into the environment in editable mode (`pip install
#     -e .` over the same build folder), once per checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

PACKAGES=(g++ cmake ninja-build ccache python3-venv python3-dev libgtest-dev nlohmann-json3-dev
          libgloo-dev)
# Callers may ask for more (the main job needs fortunes).
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
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi

VENV=${RFSDP_VENV:-$HOME/.cache/rfsdp/venv}
PY=$VENV/bin/python
if [ ! -x "$PY" ]; then
  echo "setup: making the virtual environment $VENV"
  /usr/bin/python3 -m venv "$VENV"
fi
STAMP=$VENV/.rfsdp-requirements
if ! cmp -s scripts/requirements.txt "$STAMP"; then
  echo "setup: installing scripts/requirements.txt into $VENV: torch 2.11.0 from PyPI is a" \
       "CUDA build, about 3 GB to download and 4.8 GB on disk (about 1-2 minutes here; pip's" \
       "cache makes later installs fast)"
  "$PY" -m pip install -q --disable-pip-version-check -r scripts/requirements.txt
  cp scripts/requirements.txt "$STAMP"
fi

BUILD_DIR=${RFSDP_BUILD_DIR:-build}
# ccache keys on paths relative to the checkout: another clone reuses the cache.
export CCACHE_BASEDIR="$ROOT"
if [ ! -f "$BUILD_DIR/build.ninja" ] ||
   ! grep -qx "RFSDP_PYTHON_EXE:FILEPATH=$PY" "$BUILD_DIR/CMakeCache.txt"; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DRFSDP_PYTHON_EXE:FILEPATH="$PY" \
    -DRFSDP_TESTS=ON -DRFSDP_BENCH=ON
fi
cmake --build "$BUILD_DIR"

# Editable install of this checkout (the environment may hold another checkout's).
installed=$("$PY" -c "import importlib.util as u; s = u.find_spec('rfsdp'); print(s.origin if s else '')" 2>/dev/null || true)
# The editable install maps the package's files as they were: a file added or
# removed since needs it again.
files=$(cd python && find rfsdp -name '*.py' | LC_ALL=C sort | sha256sum | cut -c1-16)
FILES_STAMP=$VENV/.rfsdp-editable-files
if [ "$installed" != "$ROOT/python/rfsdp/__init__.py" ] || [ "$(cat "$FILES_STAMP" 2>/dev/null)" != "$ROOT $files" ]; then
  echo "setup: pip install -e . (into $VENV, over $BUILD_DIR)"
  "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e . \
    --config-settings=build-dir="$BUILD_DIR" --config-settings=cmake.define.RFSDP_TESTS=ON --config-settings=cmake.define.RFSDP_BENCH=ON \
    --config-settings=cmake.define.RFSDP_PYTHON_EXE:FILEPATH="$PY"
  echo "$ROOT $files" > "$FILES_STAMP"
fi
