"""The version is written once (CMakeLists.txt's project line): the package
metadata, rfsdp.__version__ and rfsdp-plan --version all say it."""
import importlib.metadata
import os
import re

import rfsdp

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_one_version_everywhere():
    text = open(os.path.join(ROOT, "CMakeLists.txt")).read()
    want = re.search(r"project\(RaggedFSDP VERSION ([0-9.]+)", text).group(1)
    assert rfsdp.__version__ == want
    assert importlib.metadata.version("rfsdp") == want
