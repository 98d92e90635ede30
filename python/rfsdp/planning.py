"""rfsdp.plan: the RaggedShard planner from Python (the same as `rfsdp-plan`)."""
import json
import operator
from dataclasses import dataclass

from . import _C


@dataclass(frozen=True)
class PlannerOptions:
    """How a unit may be laid out (C++ rfsdp::PlannerOptions): in up to
    max_buffers flat buffers, each with its own collective, chosen by the bytes a
    rank receives in a gather (m x S x dtype bytes) plus collective_cost_bytes
    (latency x bandwidth) per buffer; one buffer whenever it is as good.
    max_buffers=1: always one buffer. Limits (the planner's, checked in C++):
    max_buffers 1..64, collective_cost_bytes 0..2^50."""
    max_buffers: int = 4
    collective_cost_bytes: int = 1 << 20

    def __post_init__(self):
        for name in ("max_buffers", "collective_cost_bytes"):
            _int64("PlannerOptions", name, getattr(self, name))
        try:  # the limits are the planner's (C++ check_planner_options)
            _C.check_planner_options(self.max_buffers, self.collective_cost_bytes)
        except ValueError as e:
            raise ValueError("PlannerOptions: %s" % e) from None


def _int64(who, name, v):
    """v as an int that fits the planner's int64 arguments (ints and numpy's; not
    bools), else a ValueError; the planner checks the limits."""
    try:
        i = None if isinstance(v, bool) else operator.index(v)
    except TypeError:
        i = None
    if i is None or not -2 ** 63 <= i < 2 ** 63:
        raise ValueError("%s: %s must be an integer that fits 64 bits, got %r" % (who, name, v))
    return i


def plan(tensors, world_size, align_bytes=16, options=None):
    """Plans one unit. `tensors`: a list of dicts in rfsdp-plan's input format,
    {"name", "shape", "granule_rows": int | "whole", "row_dims" (default 1),
    "dtype_bytes"}. Returns a Plan (S, buffers, buffer_of, offsets in each
    tensor's buffer, shard(i, rank)); Plan.to_json() prints what
    `rfsdp-plan --json` prints. Bad input raises ValueError naming the tensor or
    the value and the planner's limit (world_size 1..2^24, align_bytes 1..2^20,
    dtype_bytes 1..1024, world_size x the unit's bytes within 2^60)."""
    o = options if options is not None else PlannerOptions()
    return _C.plan_json(json.dumps(list(tensors)), _int64("rfsdp.plan", "world_size", world_size),
                        _int64("rfsdp.plan", "align_bytes", align_bytes),
                        o.max_buffers, o.collective_cost_bytes)
