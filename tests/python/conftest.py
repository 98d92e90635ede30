import os
import shutil
import sys
import tempfile

import pytest
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def build_dir():
    path = os.environ.get("RFSDP_BUILD_DIR", "build")
    return path if os.path.isabs(path) else os.path.join(ROOT, path)


@pytest.fixture(scope="session")
def plan_cli(build_dir):
    """The rfsdp-plan this environment has: the build folder's (scripts/setup.sh),
    else the one `pip install .` put beside the interpreter, else on PATH."""
    for path in (os.path.join(build_dir, "rfsdp-plan"),
                 os.path.join(os.path.dirname(sys.executable), "rfsdp-plan"),
                 shutil.which("rfsdp-plan")):
        if path and os.path.exists(path):
            return path
    pytest.fail("no rfsdp-plan: build it (scripts/setup.sh) or pip install the package")


@pytest.fixture(scope="session")
def zoo_dir():
    return os.path.join(ROOT, "bench", "zoo")


@pytest.fixture
def one_rank():
    """torch.distributed initialised as a one-rank Gloo group for the test."""
    d = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method="file://" + os.path.join(d, "init"), rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()
