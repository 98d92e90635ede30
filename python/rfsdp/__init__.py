"""RaggedFSDP: fully sharded data parallelism with block-aligned ("ragged") shards.

Build first (`bash scripts/setup.sh`), then `PYTHONPATH=python /usr/bin/python3 -c 'import rfsdp'`.
"""
import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C, optim, policy, quant
from .fsdp import (MixedPrecisionPolicy, ShardInfo, clip_grad_norm_, full_parameters, fully_shard,
                   shard_info)
from .planning import plan

__all__ = ["plan", "quant", "policy", "optim", "fully_shard", "shard_info", "ShardInfo",
           "MixedPrecisionPolicy", "clip_grad_norm_", "full_parameters"]
