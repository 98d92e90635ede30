import os
import tempfile

import pytest
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def build_dir():
    path = os.environ.get("RFSDP_BUILD_DIR", "build")
    return path if os.path.isabs(path) else os.path.join(ROOT, path)


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
