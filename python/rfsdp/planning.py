"""rfsdp.plan: the RaggedShard planner from Python (the same as `rfsdp-plan`)."""
import json
from dataclasses import dataclass

from . import _C


@dataclass(frozen=True)
class PlannerOptions:
    """How a unit may be laid out (C++ rfsdp::PlannerOptions): in up to
    max_buffers flat buffers, each with its own collective, chosen by the bytes a
    rank receives in a gather (m x S x dtype bytes) plus collective_cost_bytes
    (latency x bandwidth) per buffer; one buffer whenever it is as good.
    max_buffers=1: always one buffer."""
    max_buffers: int = 4
    collective_cost_bytes: int = 1 << 20

    def __post_init__(self):
        if isinstance(self.max_buffers, bool) or not isinstance(self.max_buffers, int) \
                or self.max_buffers < 1:
            raise ValueError("PlannerOptions: max_buffers must be an integer >= 1, got %r"
                             % (self.max_buffers,))
        if isinstance(self.collective_cost_bytes, bool) \
                or not isinstance(self.collective_cost_bytes, int) or self.collective_cost_bytes < 0:
            raise ValueError("PlannerOptions: collective_cost_bytes must be an integer >= 0, got %r"
                             % (self.collective_cost_bytes,))


def plan(tensors, world_size, align_bytes=16, options=None):
    """Plans one unit. `tensors`: a list of dicts in rfsdp-plan's input format,
    {"name", "shape", "granule_rows": int | "whole", "row_dims" (default 1),
    "dtype_bytes"}. Returns a Plan (S, buffers, buffer_of, offsets in each
    tensor's buffer, shard(i, rank)); Plan.to_json() prints what
    `rfsdp-plan --json` prints. Bad input raises ValueError naming the tensor."""
    o = options if options is not None else PlannerOptions()
    return _C.plan_json(json.dumps(list(tensors)), int(world_size), int(align_bytes),
                        o.max_buffers, o.collective_cost_bytes)
