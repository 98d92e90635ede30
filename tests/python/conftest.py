import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def build_dir():
    path = os.environ.get("RFSDP_BUILD_DIR", "build")
    return path if os.path.isabs(path) else os.path.join(ROOT, path)


@pytest.fixture(scope="session")
def zoo_dir():
    return os.path.join(ROOT, "bench", "zoo")

