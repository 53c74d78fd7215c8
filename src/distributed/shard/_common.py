"""Shared validation and group bookkeeping for the shard-dialect collectives.

Every check here depends only on the op's attributes and the local tensor's
shape, which SPMD code passes identically on every device, so each rank
reaches the same verdict before any communication starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from ..comm import ops as _comm
from ..comm.reductions import Reduction
from ..comm.runtime import ProcessGroup
from . import _index
from ._index import Shape
from .grid import Grid, check_root

T = TypeVar("T")


def check_reduction(reduction: str | Reduction) -> Reduction:
    """Return ``reduction`` as a :class:`~torchtp.comm.reductions.Reduction` or raise ``ValueError``."""
    return Reduction.parse(reduction)


def check_tensor(op: str, x: object) -> torch.Tensor:
    """Raise ``TypeError`` unless ``x`` is a tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"shard.{op}: the local input must be a torch.Tensor, got "
                        f"{type(x).__name__}")
    return x


def check_dim(op: str, x: torch.Tensor, dim: int, name: str) -> int:
    """Validate tensor axis attribute ``name`` = ``dim`` against ``x``'s rank."""
    if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"shard.{op}: {name}={dim} is out of range for the local tensor of "
                         f"shape {tuple(x.shape)} ({x.dim()} dims); use 0..{x.dim() - 1}")
    return dim % x.dim()


def check_divisible(op: str, x: torch.Tensor, dim: int, name: str, size: int,
                    axes: Sequence[int]) -> None:
    """Raise unless ``x.shape[dim]`` splits evenly into ``size`` pieces."""
    if x.shape[dim] % size:
        raise ValueError(f"shard.{op}: {name}={dim} has size {x.shape[dim]}, not divisible by "
                         f"the group size {size} (grid_axes={list(axes)}); pad it to a "
                         f"multiple of {size}")


@dataclass
class GroupInfo:
    """This device's group along ``axes`` of ``grid``.

    Attributes:
        axes: The grid axes defining the group, in in-group index order.
        shape: Group shape (sizes of ``axes``).
        members: Global ranks in in-group row-major order.
        index: This device's in-group linear index.
        pg: The process group (its ranks are sorted global ranks), ``None`` for one device.
    """

    grid: Grid
    axes: tuple[int, ...]
    shape: Shape
    members: list[int]
    index: int
    pg: ProcessGroup | None

    @property
    def size(self) -> int:
        """Number of devices in the group."""
        return len(self.members)

    def group_rank(self, k: int) -> int:
        """Process-group rank of in-group member ``k`` (groups sort global ranks)."""
        return sorted(self.members).index(self.members[k])

    def by_group_rank(self, items: Sequence[T]) -> list[T]:
        """Reorder per-member ``items`` (in-group order) into process-group rank order."""
        order = sorted(range(self.size), key=lambda k: self.members[k])
        return [items[k] for k in order]

    def from_group_rank(self, items: Sequence[T]) -> list[T]:
        """Reorder ``items`` received in process-group rank order into in-group order."""
        return [items[self.group_rank(k)] for k in range(self.size)]

    def root(self, root: int | Sequence[int], what: str) -> int:
        """In-group linear index of the in-group multi-index ``root``."""
        return _index.linear_index(check_root(root, self.shape, what, self.axes), self.shape)


def check_grid(op: str, grid: object,
               grid_axes: Sequence[int] | None) -> tuple[Grid, tuple[int, ...]]:
    """Validate ``grid`` and ``grid_axes`` (``None``: all axes)."""
    if not isinstance(grid, Grid):
        raise TypeError(f"shard.{op}: grid must be a torchtp.shard.Grid, got {type(grid).__name__}")
    return grid, _index.check_axes(grid_axes, grid.ndim)


def group_info(grid: Grid, axes: tuple[int, ...]) -> GroupInfo:
    """This device's group along ``axes`` (raises if this rank is not in the grid)."""
    device = grid.process_multi_index()
    members = grid.members(axes, device)
    shape = grid.grid_shape(axes)
    index = _index.linear_index(_index.in_group_index(device, axes), shape)
    pg = grid.group(axes) if len(members) > 1 else None
    return GroupInfo(grid, axes, shape, members, index, pg)


def record(op: str, x: torch.Tensor, pg: ProcessGroup | None) -> None:
    """Count and log one collective (visible to ``torchtp.count_collectives``).

    Not checked through the store: some of these (send/recv) differ by rank.
    """
    _comm.count(op, x, pg)


def accumulate_dtype(op: str, x: torch.Tensor, reduction: Reduction,
                     dtype: torch.dtype | None) -> torch.dtype:
    """Result/accumulation dtype: ``dtype`` or ``x.dtype``; average needs floating point."""
    out = x.dtype if dtype is None else dtype
    if reduction is Reduction.AVERAGE and not (out.is_floating_point or out.is_complex):
        raise TypeError(f"shard.{op}: reduction='average' of dtype {out} would truncate; pass "
                        "dtype=torch.float32 (or float64) to accumulate in floating point")
    return out


def finish_average(t: torch.Tensor, reduction: Reduction, size: int) -> torch.Tensor:
    """Divide a sum by the group size when the reduction is AVERAGE."""
    return t / size if reduction is Reduction.AVERAGE else t
