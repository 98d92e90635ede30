"""bench_planner --tp (issue 56's figure: Muon's bytes per step at dp=128, tp=8 for
Llama-3-70B's block) against the bytes counted here from the definition, for the
layout of torch's tensor parallelism with FSDP2's chunks over dp: q/k/v/gate/up
ColwiseParallel (rows over tp), o/down RowwiseParallel (column parts over tp),
each tp piece cut into ceil(rows / dp)-row chunks. Every block's pieces there are
of one size, so the root's choice (any holder) does not change the total."""
import math
import os
import subprocess

import pytest

HIDDEN, HEADS, KV, HEAD_DIM, FFN = 8192, 64, 8, 128, 28672
MATS = [("q", HEADS * HEAD_DIM, HIDDEN, True), ("k", KV * HEAD_DIM, HIDDEN, True),
        ("v", KV * HEAD_DIM, HIDDEN, True), ("o", HIDDEN, HEADS * HEAD_DIM, False),
        ("gate", FFN, HIDDEN, True), ("up", FFN, HIDDEN, True), ("down", HIDDEN, FFN, False)]


def reference(dp, tp, heads):
    """(blocks, bytes sent in all, bytes between ranks of different tp index):
    a block's every piece but its root's goes to the root and back, 4 bytes each way."""
    blocks = total = across = 0
    for name, rows, cols, colwise in MATS:
        local_rows, local_cols = (rows // tp, cols) if colwise else (rows, cols // tp)
        c = math.ceil(local_rows / dp)
        chunks = [(min(d * c, local_rows), min((d + 1) * c, local_rows)) for d in range(dp)]
        if heads and name in "qkv":  # a head's rows lie in one tp piece (ColwiseParallel)
            for h in range(local_rows // HEAD_DIM):
                lo, hi = h * HEAD_DIM, (h + 1) * HEAD_DIM
                pieces = [max(0, min(e, hi) - max(b, lo)) * local_cols for b, e in chunks]
                blocks += tp
                total += tp * 8 * (HEAD_DIM * cols - max(pieces))  # (the root on the tp rank)
            continue
        pieces = [(e - b) * local_cols for b, e in chunks]
        assert len(set(pieces)) == 1, "the reference assumes equal chunks"
        blocks += 1
        total += 8 * (rows * cols - pieces[0])
        across += 8 * pieces[0] * dp * (tp - 1)
    return blocks, total, across


@pytest.mark.parametrize("heads", [False, True])
def test_bench_tp_counts_muons_bytes_as_the_definition(build_dir, heads):
    bench = os.path.join(build_dir, "bench", "bench_planner")
    if not os.path.exists(bench):
        pytest.fail("no %s: build with the benches (scripts/setup.sh)" % bench)
    out = subprocess.run([bench, "--tp", "128x8", "--only", "llama3_70b.block"], check=True,
                         capture_output=True, text=True).stdout
    row = [line for line in out.splitlines()
           if line.split()[1:3] == ["tp+fsdp2", "heads" if heads else "whole"]]
    assert len(row) == 1, out
    cells = row[0].replace("|", " ").split()
    blocks, total, across = reference(128, 8, heads)
    assert int(cells[3]) == blocks, row
    assert float(cells[5]) == pytest.approx(total / 2 ** 30, abs=6e-4), (row, total)
    assert float(cells[6]) == pytest.approx(across / 2 ** 30, abs=6e-4), (row, across)
