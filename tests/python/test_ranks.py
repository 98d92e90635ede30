"""The multi-process harness itself (ranks.py): results in rank order, a rank's
error raised with its message, a hung rank killed after the timeout."""
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import run_ranks  # noqa: E402


def summed(rank, world, base):
    t = torch.tensor([float(base + rank)])
    dist.all_reduce(t)
    return rank, t.item()


def raises_on_one(rank, world):
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank


def hangs_on_one(rank, world):
    if rank == 1:
        time.sleep(600)
    return rank


def test_results_come_back_in_rank_order():
    assert run_ranks(summed, 3, 10) == [(0, 33.0), (1, 33.0), (2, 33.0)]


def test_an_error_on_one_rank_fails_the_caller():
    with pytest.raises(Exception, match="rank one refuses"):
        run_ranks(raises_on_one, 2)


def test_a_hung_rank_is_killed_after_the_timeout():
    with pytest.raises(TimeoutError, match="hangs_on_one on 2 ranks"):
        run_ranks(hangs_on_one, 2, timeout=5)
