"""rfsdp.plan from Python: the same plan as the rfsdp-plan CLI, and its errors."""
import json
import os
import subprocess

import pytest

import rfsdp


def test_to_json_equals_the_cli(plan_cli, zoo_dir):
    for unit_file in ["llama3_8b.block.json", "gpt_oss_120b.block.json"]:
        path = os.path.join(zoo_dir, unit_file)
        with open(path) as f:
            unit = json.load(f)
        for m, k in [(8, 4), (1024, 4), (1024, 1)]:
            cli = subprocess.run([plan_cli, path, "--world-size", str(m),
                                  "--max-buffers", str(k), "--json"],
                                 capture_output=True, text=True, check=True)
            want = json.loads(cli.stdout)
            got = json.loads(rfsdp.plan(unit, world_size=m,
                                        options=rfsdp.PlannerOptions(max_buffers=k)).to_json())
            want.pop("plan_seconds"), got.pop("plan_seconds")
            assert got == want


def test_several_buffers_from_python():
    """Row lengths 7 and 9 on 8 ranks: one buffer pads, two fit exactly; the plan
    object carries the buffers, and every tensor's rows tile across the ranks."""
    unit = [{"name": "a", "shape": [64, 7], "granule_rows": 1, "dtype_bytes": 4},
            {"name": "b", "shape": [64, 9], "granule_rows": 1, "dtype_bytes": 4}]
    one = rfsdp.plan(unit, 8, options=rfsdp.PlannerOptions(max_buffers=1))
    two = rfsdp.plan(unit, 8, options=rfsdp.PlannerOptions(collective_cost_bytes=0))
    assert one.buffers == [one.S] and one.buffer_of == [0, 0] and one.S > 128
    assert sorted(two.buffers) == [56, 72] and two.S == 128 and sorted(two.buffer_of) == [0, 1]
    for i, rows in [(0, 64), (1, 64)]:
        covered = []
        for r in range(8):
            begin, end, local, n = two.shard(i, r)
            covered += list(range(begin, end))
            start = sum(two.buffers[:two.buffer_of[i]])  # the tensor's buffer in the slice
            assert start <= local and local + n <= start + two.buffers[two.buffer_of[i]]
        assert covered == list(range(rows))
    for bad, words in [(dict(max_buffers=0), "max_buffers must be between 1 and 64"),
                       (dict(collective_cost_bytes=-1), "collective_cost_bytes must be between 0"),
                       (dict(max_buffers=True), "max_buffers must be an integer"),
                       (dict(max_buffers=2 ** 32 + 1), "max_buffers must be between 1 and 64 "
                                                       r"\(the planner's limit; it forms at most "
                                                       r"7\), got 4294967297"),
                       (dict(collective_cost_bytes=2 ** 64), "fits 64 bits")]:
        with pytest.raises(ValueError, match="PlannerOptions: .*" + words):
            rfsdp.PlannerOptions(**bad)


def test_shard_rows_tile_each_tensor():
    p = rfsdp.plan([{"name": "w", "shape": [10, 3], "granule_rows": 2, "dtype_bytes": 4},
                    {"name": "b", "shape": [7], "granule_rows": "whole", "dtype_bytes": 4}], 3)
    assert p.names == ["w", "b"]
    for i, rows in [(0, 10), (1, 7)]:
        covered = []
        for r in range(3):
            begin, end, _, _ = p.shard(i, r)
            covered += list(range(begin, end))
        assert covered == list(range(rows))


@pytest.mark.parametrize("tensors,world,needle", [
    ([{"name": "w", "shape": [4], "granule_rows": 0, "dtype_bytes": 2}], 2, "'w': granule_rows"),
    ([{"name": "w", "shape": [4], "granule_rows": "most", "dtype_bytes": 2}], 2, "'w': granule_rows"),
    ([{"name": "w", "shape": [4], "granule_rows": 1, "dtype_bytes": 2}], 0, "world size"),
    ([], 2, "empty"),
    # the planner's limits, checked in C++ (the CLI's same messages: test_rfsdp_plan_cli.py)
    ([{"name": "w", "shape": [4], "granule_rows": 1, "dtype_bytes": 2}], 2 ** 62,
     r"world size must be between 1 and 16777216 \(2\^24: the planner's limit\), got %d" % 2 ** 62),
    ([{"name": "w", "shape": [4], "granule_rows": 1, "dtype_bytes": 2}], 2 ** 64,
     r"rfsdp.plan: world_size must be an integer that fits 64 bits, got %d" % 2 ** 64),
])
def test_errors_are_value_errors_naming_the_problem(tensors, world, needle):
    with pytest.raises(ValueError, match=needle):
        rfsdp.plan(tensors, world)


def test_row_geometry_is_the_planners():
    """One definition of rows (TensorSpec): rows of the first row_dims dims."""
    from rfsdp import _C
    assert _C.row_geometry([3, 4, 5], 1) == (3, 20)
    assert _C.row_geometry([3, 4, 5], 2) == (12, 5)
    assert _C.row_geometry([3, 4, 5], 3) == (60, 1)
    assert _C.row_geometry([7], 1) == (7, 1)
    assert _C.row_geometry([], 1) == (1, 1)
    with pytest.raises(ValueError, match="row_dims 3 is out of range"):
        _C.row_geometry([3, 4], 3)
    plan = rfsdp.plan([{"name": "w", "shape": [6, 4, 5], "granule_rows": 1, "row_dims": 2,
                        "dtype_bytes": 4}], world_size=2)  # rows of the first 2 dims
    begin, end, _, numel = plan.shard(0, 1)
    assert numel == (end - begin) * 5


def test_planner_options_defaults_are_the_clis(plan_cli, zoo_dir):
    """rfsdp.PlannerOptions is the C++ struct: its defaults are those rfsdp-plan
    uses when given no flags (the same plan), and it compares, hashes, pickles
    and prints as a value."""
    import pickle
    path = os.path.join(zoo_dir, "llama3_8b.block.json")
    with open(path) as f:
        unit = json.load(f)
    cli = subprocess.run([plan_cli, path, "--world-size", "1024", "--json"],
                         capture_output=True, text=True, check=True)
    want = json.loads(cli.stdout)
    got = json.loads(rfsdp.plan(unit, world_size=1024, options=rfsdp.PlannerOptions()).to_json())
    want.pop("plan_seconds"), got.pop("plan_seconds")
    assert got == want and got["align_bytes"] == 16
    o = rfsdp.PlannerOptions(max_buffers=2, collective_cost_bytes=5)
    assert (o.max_buffers, o.collective_cost_bytes) == (2, 5)
    assert o == rfsdp.PlannerOptions(max_buffers=2, collective_cost_bytes=5) != rfsdp.PlannerOptions()
    assert hash(o) == hash(pickle.loads(pickle.dumps(o))) and pickle.loads(pickle.dumps(o)) == o
    assert repr(o) == "PlannerOptions(max_buffers=2, collective_cost_bytes=5)"
    np = pytest.importorskip("numpy")
    assert rfsdp.PlannerOptions(max_buffers=np.int64(3)).max_buffers == 3
    with pytest.raises(ValueError, match="rfsdp.plan: world_size must be an integer"):
        rfsdp.plan(unit, world_size=2.0)
