"""The GPU tests rehearsed on the CPU: test_gpu.py runs, in a fresh interpreter, with
the CPU standing in for the GPU (RFSDP_GPU_TESTS_ON_CPU=1, see there). The GPU
machine is lent only at times and its minutes are few; without this the GPU tests
are skipped in every run here and rot unseen (an API renamed, a helper's arguments
changed) until a GPU run fails on them. What a GPU computes is tested only there."""
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


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
