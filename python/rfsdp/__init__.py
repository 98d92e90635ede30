"""RaggedFSDP: fully sharded data parallelism with block-aligned ("ragged") shards.

Build first (`bash scripts/setup.sh`), then `PYTHONPATH=python /usr/bin/python3 -c 'import rfsdp'`.
"""
import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C, quant
from .planning import plan

__all__ = ["plan", "quant"]
