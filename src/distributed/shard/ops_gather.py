"""Shard-dialect collectives that gather, reduce or slice without a root.

Signatures follow the dialect: the local tensor, then the grid, then the
op's attributes; ``grid_axes=None`` means every grid axis. Devices are
grouped along ``grid_axes``; pieces are ordered by the in-group multi-index
(row-major in the order ``grid_axes`` lists the axes). Every result is a
fresh tensor on the input's device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..comm import ops as _comm
from ..comm.reductions import torch_op
from ..core.layouts import shard_range
from . import _common as c
from .grid import Grid


def all_gather(x: torch.Tensor, grid: Grid, gather_axis: int, *,
               grid_axes: Sequence[int] | None = None) -> torch.Tensor:
    """Concatenate the group's pieces along ``gather_axis`` on every device (shard.all_gather).

    Args:
        x: This device's piece; the same shape on every device of the group.
        grid: The process grid.
        gather_axis: Tensor dim to concatenate along.
        grid_axes: Grid axes defining the groups (all when ``None``).

    Returns:
        ``x`` with dim ``gather_axis`` multiplied by the group size, replicated in the group.
    """
    x = c.check_tensor("all_gather", x)
    grid, axes = c.check_grid("all_gather", grid, grid_axes)
    dim = c.check_dim("all_gather", x, gather_axis, "gather_axis")
    g = c.group_info(grid, axes)
    if g.size == 1:
        return x.clone()
    # (size * d0, ...) in process-group rank order; reorder to in-group order.
    stacked = _comm.all_gather(x.unsqueeze(0), 0, g.pg)
    pieces = g.from_group_rank(list(stacked.unbind(0)))
    return torch.cat(pieces, dim=dim)


def all_reduce(x: torch.Tensor, grid: Grid, *, grid_axes: Sequence[int] | None = None,
               reduction: str | c.Reduction = "sum", dtype: torch.dtype | None = None
               ) -> torch.Tensor:
    """Reduce ``x`` element-wise over the group; every device gets it (``shard.all_reduce``).

    Args:
        x: This device's tensor; the same shape on every device of the group.
        grid: The process grid.
        grid_axes: Grid axes defining the groups (all when ``None``).
        reduction: ``"sum"``, ``"max"``, ``"min"``, ``"product"`` or ``"average"``.
        dtype: Result (accumulation) dtype; inputs are converted first, as in the
            dialect's ``tensor<3x4xf32> -> tensor<3x4xf64>``.
    """
    x = c.check_tensor("all_reduce", x)
    grid, axes = c.check_grid("all_reduce", grid, grid_axes)
    red = c.check_reduction(reduction)
    out_dtype = c.accumulate_dtype("all_reduce", x, red, dtype)
    g = c.group_info(grid, axes)
    t = x.to(out_dtype, copy=True).contiguous()
    if g.size == 1:
        return t
    return c.finish_average(_comm.all_reduce_(t, g.pg, red), red, g.size)


def all_slice(x: torch.Tensor, grid: Grid, slice_axis: int, *,
              grid_axes: Sequence[int] | None = None) -> torch.Tensor:
    """Keep this device's in-group slice of ``x`` along ``slice_axis`` (``shard.all_slice``).

    No communication: the inverse of :func:`all_gather` for replicated input.
    """
    x = c.check_tensor("all_slice", x)
    grid, axes = c.check_grid("all_slice", grid, grid_axes)
    dim = c.check_dim("all_slice", x, slice_axis, "slice_axis")
    g = c.group_info(grid, axes)
    c.check_divisible("all_slice", x, dim, "slice_axis", g.size, axes)
    start, n = shard_range(x.shape[dim], g.size, g.index)  # equal shares: checked divisible
    return x.narrow(dim, start, n).clone(memory_format=torch.contiguous_format)


def all_to_all(x: torch.Tensor, grid: Grid, split_axis: int, concat_axis: int, *,
               grid_axes: Sequence[int] | None = None) -> torch.Tensor:
    """Split ``x`` along ``split_axis``, send piece k to member k, concatenate what arrives.

    ``shard.all_to_all``: the received pieces are concatenated along
    ``concat_axis`` in in-group order.
    """
    x = c.check_tensor("all_to_all", x)
    grid, axes = c.check_grid("all_to_all", grid, grid_axes)
    split = c.check_dim("all_to_all", x, split_axis, "split_axis")
    concat = c.check_dim("all_to_all", x, concat_axis, "concat_axis")
    g = c.group_info(grid, axes)
    c.check_divisible("all_to_all", x, split, "split_axis", g.size, axes)
    if g.size == 1:
        return x.clone()
    # Put split_axis first so each outgoing piece is one contiguous block,
    # laid out in process-group rank order as all_to_all_single expects.
    pieces = list(x.movedim(split, 0).chunk(g.size, dim=0))
    send = torch.cat(g.by_group_rank(pieces), dim=0).contiguous()
    recv = torch.empty_like(send)
    c.record("all_to_all", send, g.pg)
    dist.all_to_all_single(recv, send, group=g.pg)
    got = g.from_group_rank(list(recv.chunk(g.size, dim=0)))
    return torch.cat([p.movedim(0, split) for p in got], dim=concat)


def reduce_scatter(x: torch.Tensor, grid: Grid, scatter_axis: int, *,
                   grid_axes: Sequence[int] | None = None, reduction: str | c.Reduction = "sum",
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """Reduce ``x`` over the group and give member k the k-th piece along ``scatter_axis``.

    ``shard.reduce_scatter``; ``reduction`` and ``dtype`` as in :func:`all_reduce`.
    """
    x = c.check_tensor("reduce_scatter", x)
    grid, axes = c.check_grid("reduce_scatter", grid, grid_axes)
    dim = c.check_dim("reduce_scatter", x, scatter_axis, "scatter_axis")
    red = c.check_reduction(reduction)
    out_dtype = c.accumulate_dtype("reduce_scatter", x, red, dtype)
    g = c.group_info(grid, axes)
    c.check_divisible("reduce_scatter", x, dim, "scatter_axis", g.size, axes)
    t = x.to(out_dtype)
    if g.size == 1:
        return t.clone()
    pieces = list(t.movedim(dim, 0).chunk(g.size, dim=0))
    full = torch.cat(g.by_group_rank(pieces), dim=0).contiguous()
    out = torch.empty_like(pieces[0], memory_format=torch.contiguous_format)
    c.record("reduce_scatter", full, g.pg)
    _comm.reduce_scatter_single(out, full, op=torch_op(red), group=g.pg)
    return c.finish_average(out.movedim(0, dim).contiguous(), red, g.size)
