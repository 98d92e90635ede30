"""RaggedFSDP: fully sharded data parallelism with block-aligned ("ragged") shards.

Install with `pip install .` into an environment holding torch 2.x (the
extension is built against that torch), or use the project's environment that
`bash scripts/setup.sh` makes (~/.cache/rfsdp/venv, an editable install).
"""
import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C, checkpoint, dcp, optim, policy, quant

__version__ = _C.__version__  # CMakeLists.txt's project() version, as the wheel's
from .dcp import ShardedRows, get_state_dict_type, set_state_dict_type
from .fsdp import (FSDPModule, MixedPrecisionPolicy, ShardGrad, ShardInfo, clip_grad_norm_,
                   full_parameters, fully_shard, global_numel, set_prefetch, shard_info)
from .planning import PlannerOptions, plan

CommPolicy = _C.CommPolicy  # how fully_shard's collectives carry the data (C++: fsdp/comm_policy.h)

__all__ = ["plan", "PlannerOptions", "CommPolicy", "quant", "policy", "optim", "checkpoint", "dcp", "fully_shard", "shard_info", "ShardInfo",
           "MixedPrecisionPolicy", "clip_grad_norm_", "full_parameters", "set_prefetch", "FSDPModule",
           "ShardedRows", "ShardGrad", "global_numel", "set_state_dict_type", "get_state_dict_type"]
