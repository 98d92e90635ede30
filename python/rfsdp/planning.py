"""rfsdp.plan: the RaggedShard planner from Python (the same as `rfsdp-plan`)."""
import json

from . import _C

# The planner's options (C++ rfsdp::PlannerOptions: its defaults, its limits).
PlannerOptions = _C.PlannerOptions


def plan(tensors, world_size, align_bytes=None, options=None):
    """Plans one unit. `tensors`: a list of dicts in rfsdp-plan's input format,
    {"name", "shape", "granule_rows": int | "whole", "row_dims" (default 1),
    "dtype_bytes"}. align_bytes None: the planner's default (16). Returns a Plan
    (S, buffers, buffer_of, offsets in each tensor's buffer, shard(i, rank));
    Plan.to_json() prints what `rfsdp-plan --json` prints. Bad input raises
    ValueError naming the tensor or the value and the planner's limit
    (world_size 1..2^24, align_bytes 1..2^20, dtype_bytes 1..1024, world_size x
    the unit's bytes within 2^60)."""
    kw = {} if align_bytes is None else {"align_bytes": align_bytes}
    if options is not None:
        kw["options"] = options
    return _C.plan_json(json.dumps(list(tensors)), world_size, **kw)
