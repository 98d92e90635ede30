"""rfsdp.fully_shard: FSDP2's per-module sharding over RaggedFSDP units, in files
of one concern each (as FSDP2 splits it): api (fully_shard, FSDPModule, helpers),
unit (one call's parameters: shards, hooks, gradients), schedule (prefetch order),
trees (tensors in inputs and outputs), grad_norm (global norms of sharded
gradients), state_dict (a model's full and sharded state dicts; the pieces and
their gathering are rfsdp.dcp's)."""
from .api import (FSDPModule, UnshardHandle, clip_grad_norm_, full_parameters, fully_shard,
                  global_numel, set_prefetch, units)
from .grad_norm import PartialNorm, ShardGrad
from .unit import DataState, MixedPrecisionPolicy, ShardInfo, TrainingState, shard_info

__all__ = ["FSDPModule", "UnshardHandle", "clip_grad_norm_", "full_parameters", "fully_shard",
           "global_numel", "set_prefetch", "units", "PartialNorm", "ShardGrad", "DataState",
           "MixedPrecisionPolicy", "ShardInfo", "TrainingState", "shard_info"]
