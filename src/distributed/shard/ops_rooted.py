"""Shard-dialect collectives with a ``root``: broadcast, gather, reduce, scatter.

``root`` is the root's in-group multi-index: one entry per grid axis in
``grid_axes``, in that order (an int is accepted for one-axis groups). Where
the dialect leaves the result on non-root devices undefined (``gather``,
``reduce``), torchtp returns zeros of the result's shape and dtype, so every
device gets a tensor of the type the dialect declares and nothing random.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..comm import ops as _comm
from ..comm.reductions import torch_op
from . import _common as c
from .grid import Grid

Root = int | Sequence[int]


def broadcast(x: torch.Tensor, grid: Grid, root: Root, *,
              grid_axes: Sequence[int] | None = None) -> torch.Tensor:
    """Copy the root's ``x`` to every device of its group (``shard.broadcast``).

    Non-root inputs are ignored but must have the root's shape and dtype.
    """
    x = c.check_tensor("broadcast", x)
    grid, axes = c.check_grid("broadcast", grid, grid_axes)
    g = c.group_info(grid, axes)
    k = g.root(root, "root")
    if g.size == 1:
        return x.clone()
    return _comm.broadcast(x, g.group_rank(k), g.pg)


def gather(x: torch.Tensor, grid: Grid, gather_axis: int, root: Root, *,
           grid_axes: Sequence[int] | None = None) -> torch.Tensor:
    """Concatenate the group's pieces along ``gather_axis`` on the root (``shard.gather``).

    Returns:
        On the root: the pieces concatenated in in-group order. Elsewhere:
        zeros of the same shape and dtype (the dialect's "undefined").
    """
    x = c.check_tensor("gather", x)
    grid, axes = c.check_grid("gather", grid, grid_axes)
    dim = c.check_dim("gather", x, gather_axis, "gather_axis")
    g = c.group_info(grid, axes)
    k = g.root(root, "root")
    if g.size == 1:
        return x.clone()
    local = x.contiguous()
    is_root = g.index == k
    bufs = [torch.empty_like(local) for _ in range(g.size)] if is_root else None
    c.record("gather", local, g.pg)
    dist.gather(local, bufs, dst=g.members[k], group=g.pg)
    if bufs is None:
        shape = list(x.shape)
        shape[dim] *= g.size
        return torch.zeros(shape, dtype=x.dtype, device=x.device)
    return torch.cat(g.from_group_rank(bufs), dim=dim)


def reduce(x: torch.Tensor, grid: Grid, root: Root, *, grid_axes: Sequence[int] | None = None,
           reduction: str | c.Reduction = "sum", dtype: torch.dtype | None = None
           ) -> torch.Tensor:
    """Reduce ``x`` element-wise over the group onto the root (``shard.reduce``).

    Args:
        x: This device's tensor; the same shape on every device of the group.
        grid: The process grid.
        root: The root's in-group multi-index.
        grid_axes: Grid axes defining the groups (all when ``None``).
        reduction: ``"sum"``, ``"max"``, ``"min"``, ``"product"`` or ``"average"``.
        dtype: Result (accumulation) dtype.

    Returns:
        The reduction on the root; zeros of its shape and dtype elsewhere.
    """
    x = c.check_tensor("reduce", x)
    grid, axes = c.check_grid("reduce", grid, grid_axes)
    red = c.check_reduction(reduction)
    out_dtype = c.accumulate_dtype("reduce", x, red, dtype)
    g = c.group_info(grid, axes)
    k = g.root(root, "root")
    t = x.to(out_dtype, copy=True).contiguous()
    if g.size == 1:
        return t
    c.record("reduce", t, g.pg)
    dist.reduce(t, dst=g.members[k], op=torch_op(red), group=g.pg)
    if g.index != k:
        return torch.zeros_like(t)
    return c.finish_average(t, red, g.size)


def scatter(x: torch.Tensor, grid: Grid, scatter_axis: int, root: Root, *,
            grid_axes: Sequence[int] | None = None) -> torch.Tensor:
    """Split the root's ``x`` along ``scatter_axis``; member k gets piece k (``shard.scatter``).

    Non-root inputs are ignored but must have the root's shape and dtype.
    """
    x = c.check_tensor("scatter", x)
    grid, axes = c.check_grid("scatter", grid, grid_axes)
    dim = c.check_dim("scatter", x, scatter_axis, "scatter_axis")
    g = c.group_info(grid, axes)
    k = g.root(root, "root")
    c.check_divisible("scatter", x, dim, "scatter_axis", g.size, axes)
    n = x.shape[dim] // g.size
    if g.size == 1:
        return x.clone()
    out = torch.empty_like(x.narrow(dim, 0, n), memory_format=torch.contiguous_format)
    pieces = None
    if g.index == k:
        pieces = [p.contiguous() for p in g.by_group_rank(list(x.split(n, dim=dim)))]
    c.record("scatter", out, g.pg)
    dist.scatter(out, pieces, src=g.members[k], group=g.pg)
    return out
