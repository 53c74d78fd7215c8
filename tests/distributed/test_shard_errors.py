"""Invalid attributes fail on every rank before any communication; the 2x4 shift example."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from torchtp import shard
from torchtp.shard import Grid


def _expect(fn: Any, exc: type[BaseException], pattern: str) -> str:
    try:
        fn()
    except exc as err:
        if not re.search(pattern, str(err)):
            raise AssertionError(f"{err!r} does not match {pattern!r}") from err
        return type(err).__name__
    raise AssertionError(f"no {exc.__name__} for {pattern!r}")


CASES: list[tuple[str, type[BaseException], str]] = [
    ("gather_axis", ValueError, r"shard.all_gather: gather_axis=2 is out of range for the local "
                                r"tensor of shape \(2, 2\) \(2 dims\); use 0..1"),
    ("grid_axes", ValueError, r"grid_axes=\[2\]: axis 2 is out of range for a grid with 2 axes"),
    ("shift_axis", ValueError, r"shift_axis=0 must be one of grid_axes=\[1\]"),
    ("root", ValueError, r"root=\[2\] is not an in-group multi-index of the group along "
                         r"grid_axes=\[0\] of shape \(2,\)"),
    ("root_len", ValueError, r"root=\[0, 0\] is not an in-group multi-index"),
    ("uneven", ValueError, r"shard.scatter: scatter_axis=0 has size 3, not divisible by the "
                           r"group size 2 \(grid_axes=\[0\]\); pad it to a multiple of 2"),
    ("reduction", ValueError, r"reduction='mean' is not supported; use one of sum, max, min, "
                              r"product, average"),
    ("average_int", TypeError, r"reduction='average' of dtype torch.int64 would truncate"),
    ("not_tensor", TypeError, r"shard.broadcast: the local input must be a torch.Tensor"),
    ("send_self", ValueError, r"shard.send: destination=\[[01]\] is this device"),
]


def _errors(rank: int, world_size: int) -> list[str]:
    grid = Grid((2, 2))
    line = Grid((3,), ranks=[0, 1, 2], name="line")
    x = torch.ones(2, 2)
    calls = {
        "gather_axis": lambda: shard.all_gather(x, grid, 2),
        "grid_axes": lambda: shard.all_reduce(x, grid, grid_axes=[2]),
        "shift_axis": lambda: shard.shift(x, grid, 0, 1, grid_axes=[1]),
        "root": lambda: shard.broadcast(x, grid, [2], grid_axes=[0]),
        "root_len": lambda: shard.reduce(x, grid, [0, 0], grid_axes=[0]),
        "uneven": lambda: shard.scatter(torch.ones(3, 2), grid, 0, [0], grid_axes=[0]),
        "reduction": lambda: shard.all_reduce(x, grid, reduction="mean"),
        "average_int": lambda: shard.all_reduce(torch.ones(2, dtype=torch.long), grid,
                                                reduction="average"),
        "not_tensor": lambda: shard.broadcast([1, 2], grid, 0, grid_axes=[0]),  # type: ignore
        "send_self": lambda: shard.send(x, grid, [grid.process_multi_index([1])[0]],
                                        grid_axes=[1]),
    }
    seen = [_expect(calls[name], exc, pat) for name, exc, pat in CASES]
    if rank == 3:
        seen.append(_expect(lambda: shard.all_gather(x, line, 0), RuntimeError,
                            r"rank 3 is not a device of Grid\(@line, shape=\(3,\), "
                            r"ranks=\[0, 1, 2\]\)"))
        assert not line.is_member
    # A collective still works afterwards: nobody is stuck half-way.
    seen.append(str(shard.all_reduce(torch.ones(1), grid).item()))
    return seen


def test_invalid_attributes_raise_on_every_rank_without_hanging(ranks):
    results = ranks(_errors, 4, timeout=120, gloo_timeout=30)
    for rank, seen in enumerate(results):
        assert seen[:len(CASES)] == [exc.__name__ for _, exc, _ in CASES]
        assert seen[-1] == "4.0"
        assert len(seen) == len(CASES) + 1 + (rank == 3)


def _shift_2x4(rank: int, world_size: int) -> list[int]:
    grid = Grid((2, 4))
    value = torch.tensor([rank + 1], dtype=torch.int8)  # the dialect's 1..8
    return shard.shift(value, grid, 1, 2, grid_axes=[1], rotate=True).tolist()


def test_shift_rotate_example_2x4(ranks):
    got = ranks(_shift_2x4, 8, timeout=120, gloo_timeout=60)
    assert [v[0] for v in got] == [3, 4, 1, 2, 7, 8, 5, 6]


def test_errors_without_processes():
    grid = Grid((2, 2))
    with pytest.raises(RuntimeError, match=r"has no processes"):
        shard.all_gather(torch.ones(2), grid, 0)
