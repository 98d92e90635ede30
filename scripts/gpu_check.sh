#!/usr/bin/env bash
# The GPU path checked on a GPU machine in one command (meant to fit in 8 minutes
# on an H200 with 16 cores; not yet timed there): builds the library, the extension and the C++ tests with that
# machine's python3 (torch with CUDA) and nvcc, then runs
#   1. the C++ suite (ctest; the CUDA kernels against the CPU ones among it),
#   2. the GPU tests (tests/python/test_gpu.py): every 8-bit state step on the CUDA
#      kernels and on the device-generic path bit for bit the CPU kernels'; AdamW8bit,
#      8-bit Muon momentum, SOAP 8-bit moments with int8 bases, Shampoo int8 roots,
#      each on both paths, against the CPU; AdamW8bit, Shampoo and SOAP 8-bit on FSDP2 chunk rows
#      (two processes on the GPU over Gloo) against one CPU process; AdamW, Muon,
#      Shampoo, SOAP; fully_shard over NCCL and over Gloo,
#   3. the main job on the GPU (torchrun, 1 rank, NCCL; every optimizer, 40 steps
#      on the project's own docs as text: the machine has no fortunes), and the C++
#      example (examples/cpp, built against the installed package) with AdamW8bit
#      and Muon on the GPU: its loss must fall to under half,
#   4. the table (bench/gpu_bench.py), also written to $OUT/gpu_table.md when OUT
#      is set; logs go to $OUT as well.
# Needs .gpu_deps (scripts/gpu_deps.sh, run where the project is set up). Exits
# non-zero if a step failed; every step runs regardless.
#   device run: bash scripts/gpu_check.sh        (carry: .gpu_deps)
#   RFSDP_GPU_CHECK_BUILD_ONLY=1: the build alone (also on a CPU machine, to check it)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEPS=$(pwd)/.gpu_deps
BUILD=${RFSDP_GPU_BUILD_DIR:-build-gpu}
[[ $BUILD = /* ]] || BUILD=$(pwd)/$BUILD
GTEST=$BUILD/_gtest
LOGS=${OUT:-/tmp}
t0=$SECONDS
status=0
log() { echo "[gpu_check $((SECONDS - t0)) s] $*"; }
step() {  # step NAME COMMAND...: runs it, logs to $LOGS/NAME.log, remembers a failure
  local name=$1
  shift
  log "$name"
  if ! "$@" 2>&1 | tee "$LOGS/$name.log"; then
    log "$name FAILED"
    status=1
    return 1
  fi
}

BUILD_ONLY=${RFSDP_GPU_CHECK_BUILD_ONLY:-0}
if [ "$BUILD_ONLY" != 1 ]; then
  "$PY" -c "import torch; assert torch.cuda.is_available(), 'no GPU is visible'; \
print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name())" || exit 1
fi
[ -d "$DEPS" ] || { echo "gpu_check: $DEPS is missing: run scripts/gpu_deps.sh here, carry .gpu_deps"; exit 1; }
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH

build() {
  # GoogleTest built there, into the build folder (.gpu_deps carries sources only).
  if [ ! -f "$GTEST/lib/cmake/GTest/GTestConfig.cmake" ] &&
     [ ! -f "$GTEST/lib64/cmake/GTest/GTestConfig.cmake" ]; then
    cmake -S "$DEPS/googletest" -B "$BUILD/_gtest-build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_INSTALL_PREFIX="$GTEST" -DCMAKE_POSITION_INDEPENDENT_CODE=ON >/dev/null &&
      cmake --build "$BUILD/_gtest-build" >/dev/null &&
      cmake --install "$BUILD/_gtest-build" >/dev/null || return 1
  fi
  local flags=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DRFSDP_PYTHON_EXE="$(command -v "$PY")"
               -DRFSDP_CUDA=ON -DRFSDP_TESTS=ON -DRFSDP_BENCH=OFF
               -DCMAKE_PREFIX_PATH="$GTEST;$DEPS/usr" -DGTEST_ROOT="$GTEST"
               -DCMAKE_CXX_FLAGS="-isystem $DEPS/usr/include")
  if ! cmake -S . -B "$BUILD" "${flags[@]}"; then
    # Without the extension (e.g. no Python headers there) the C++ checks still run.
    echo "gpu_check: configuring with the Python extension failed; retrying without it" \
         "(the Python steps will fail)"
    cmake -S . -B "$BUILD" "${flags[@]}" -DRFSDP_PYTHON=OFF || return 1
  fi
  cmake --build "$BUILD" -j "$(nproc)"
}
step build build || { log "the build failed: nothing to run"; exit 1; }
[ "$BUILD_ONLY" = 1 ] && { log "built"; exit 0; }
# (the Package tests install and rebuild out of tree: CPU CI covers them)
step ctest ctest --test-dir "$BUILD" -j 8 --output-on-failure --timeout 300 -E "^Package\\."
export PYTHONPATH=$(pwd)/python${PYTHONPATH:+:$PYTHONPATH}
# (every CPU kernel set rounds as the GPU's: IEEE sqrt and division, no FMA)
step pytest_gpu "$PY" -m pytest -q -p no:cacheprovider --durations 10 tests/python/test_gpu.py -rs
cat README.md docs/*.md > /tmp/rfsdp_text.txt
step main_job_gpu "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 \
  examples/train_gpt.py --compare --device cuda --steps 40 --val-every 20 --log-every 20 \
  --text /tmp/rfsdp_text.txt --plot /tmp/rfsdp_loss_curves_gpu.png  # $OUT keeps to 7 files
# The C++ example against the installed package (tests/package/run.sh installs it
# and builds examples/cpp out of tree; the carried headers on CMake's path).
cxx_example() {
  local opt
  # one install and out-of-tree build, both optimizers run from it
  CMAKE_PREFIX_PATH="$DEPS/usr" bash tests/package/run.sh "$BUILD" examples/cpp \
    bash -c 'set -o pipefail; for opt in adamw8bit muon; do
      "$0" -m torch.distributed.run --standalone --nproc_per_node 1 --no-python \
        @BIN@/train_mlp --device cuda --optimizer $opt --steps 200 --log-every 50 \
        | tee /tmp/rfsdp_cxx_$opt.log || exit 1; done' "$PY" || return 1
  for opt in adamw8bit muon; do
    awk '/^step/ {if (!n++) first = $4; last = $4}
      END {if (!(n > 1 && last < 0.5 * first)) {print FILENAME ": the loss did not halve"; exit 1}}' \
      "/tmp/rfsdp_cxx_$opt.log" || return 1
  done
}
step cxx_example_gpu cxx_example
step bench "$PY" bench/gpu_bench.py ${OUT:+--out "$OUT/gpu_table.md"}
log "done: $([ $status -eq 0 ] && echo passed || echo 'FAILED (see above)')"
exit $status
