"""rfsdp.plan: the RaggedShard planner from Python (the same as `rfsdp-plan`)."""
import json

from . import _C


def plan(tensors, world_size, align_bytes=16):
    """Plans one unit. `tensors`: a list of dicts in rfsdp-plan's input format,
    {"name", "shape", "granule_rows": int | "whole", "row_dims" (default 1),
    "dtype_bytes"}. Returns a Plan; Plan.to_json() prints what
    `rfsdp-plan --json` prints. Bad input raises ValueError naming the tensor."""
    return _C.plan_json(json.dumps(list(tensors)), int(world_size), int(align_bytes))
