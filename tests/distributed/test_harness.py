"""The harness itself must fail when a rank fails and end on time when one hangs."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from .harness import RankFailure


def _return_rank_sum(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _rank1_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    time.sleep(0.5)


def _rank0_hangs(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(3600)


def _rank1_aborts(rank: int, world_size: int) -> None:
    if rank == 1:
        os.abort()


def _rank1_says_then_aborts(rank: int, world_size: int) -> None:
    if rank == 1:
        os.write(2, b"what the C++ runtime printed before the abort\n")
        os.abort()


def _rank1_aborts_in_teardown(rank: int, world_size: int) -> int:
    if rank == 1:
        # Stands in for a backend that aborts while the harness ends the group
        # (the harness calls dist.destroy_process_group after writing the result).
        dist.destroy_process_group = lambda *a, **k: os.abort()
    return rank


def _rank1_raises_before_collective(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 broke before the all-reduce")
    dist.all_reduce(torch.ones(1))


def test_runs_every_rank_and_returns_values(ranks):
    assert ranks(_return_rank_sum, 3) == [3.0, 3.0, 3.0]


def test_failing_rank_fails_the_test_with_its_traceback(ranks):
    with pytest.raises(RankFailure, match=r"(?s)rank 1 failed.*deliberate failure on rank 1"):
        ranks(_rank1_raises, 2)


def test_hang_ends_at_the_deadline(ranks):
    start = time.monotonic()
    # 8 s: at a load average of 10 on 2 cores the other rank needed more than 3 s to
    # start, join the group and return, and was counted as hung too.
    with pytest.raises(RankFailure, match=r"rank\(s\) \[0\] did not finish within the 8s"):
        ranks(_rank0_hangs, 2, timeout=8)
    assert time.monotonic() - start < 20


def test_hard_crash_is_reported(ranks):
    with pytest.raises(RankFailure, match=r"rank 1 died without a result \(exit code -6\)"):
        ranks(_rank1_aborts, 2)


def test_a_crashed_rank_s_stderr_is_quoted(ranks):
    # A SIGABRT leaves no traceback: what the rank wrote to fd 2 is all there is.
    with pytest.raises(RankFailure, match=r"(?s)rank 1 died without a result \(exit code -6\)"
                       r".*stderr of rank 1.*what the C\+\+ runtime printed"):
        ranks(_rank1_says_then_aborts, 2)


def test_a_rank_that_returned_then_aborted_fails_the_run(ranks):
    with pytest.raises(RankFailure, match=r"rank 1 returned, then exited with code -6"):
        ranks(_rank1_aborts_in_teardown, 2)


def test_rank_raising_before_collective_does_not_hang_the_others(ranks):
    # Rank 0 waits in all_reduce for a peer that is gone; it must end well
    # before the deadline and the root cause (rank 1) must be reported first.
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"(?s)^.*?rank 1 failed.*broke before the all-reduce"):
        ranks(_rank1_raises_before_collective, 2, timeout=60, gloo_timeout=5)
    assert time.monotonic() - start < 30


def test_the_last_attempt_starts_from_spawned_processes(ranks, monkeypatch):
    # Spawn is only reached after two failed rendezvous, so run it on its own here.
    from . import harness

    monkeypatch.setattr(harness, "START_METHODS", ("spawn",))
    assert ranks(_return_rank_sum, 2) == [1.0, 1.0]
