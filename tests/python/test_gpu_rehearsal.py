"""The GPU tests and bench rehearsed on the CPU: test_gpu.py runs, in a fresh
interpreter, with the CPU standing in for the GPU (RFSDP_GPU_TESTS_ON_CPU=1, see
there), and bench/gpu_bench.py --rehearse runs every line with tiny sizes. The GPU
machine is lent only at times and its minutes are few; without this the GPU tests
are skipped in every run here and rot unseen (an API renamed, a helper's arguments
changed) until a GPU run fails on them. What a GPU computes is tested only there."""
import collections
import math
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: test_gpu.py runs on it")
def test_the_gpu_tests_run_with_the_cpu_standing_in_for_the_gpu():
    env = dict(os.environ, RFSDP_GPU_TESTS_ON_CPU="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
           os.path.join(HERE, "test_gpu.py")]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    out = r.stdout + r.stderr
    assert r.returncode == 0, "the GPU tests failed on the CPU:\n" + out[-8000:]
    # every test but the NCCL ones ran (none skipped for another reason)
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert all("NCCL" in line for line in skipped), "\n".join(skipped)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: gpu_check.sh runs the bench")
def test_the_gpu_bench_runs_with_the_cpu_standing_in_for_the_gpu(tmp_path):
    out = str(tmp_path / "table.md")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_bench.py"), "--rehearse",
                        "--out", out], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, "gpu_bench.py --rehearse failed:\n" + (r.stdout + r.stderr)[-8000:]
    table = open(out).read()
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in table.splitlines() if line.startswith("| ")][1:]  # (the header)
    # every line of each section: 3 kernels x 2 block layouts, 2 shapes, 4 GPT setups, 1
    sections = collections.Counter(r[0] for r in rows)
    assert sections == {"8-bit": 6, "Newton–Schulz": 2, "GPT step": 4, "overlap": 1}, table
    for r in rows:  # (the figures mean nothing here, but each is a number)
        assert len(r) == 6 and math.isfinite(float(r[4])), r
        assert math.isfinite(float(r[2].split()[0])), r
