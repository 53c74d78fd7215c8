"""``unshard``: the collective inverse of :func:`~torchtp.shard.shard`."""

from __future__ import annotations

import torch

from ..comm import ops as _comm
from ._common import group_info
from .grid import Grid
from .sharding import Sharding, assemble, shard_shape


def unshard(local: torch.Tensor, sharding: Sharding, grid: Grid,
            shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """Gather every device's piece and return the full tensor on every device.

    Pieces may differ in shape (``sharded_dims_offsets``): each is zero-padded
    to the largest piece for one all-gather over the whole grid, then cropped.

    Args:
        local: This device's piece (as returned by :func:`shard`).
        sharding: The sharding the pieces were cut with.
        grid: The process grid (every member calls this).
        shape: Full tensor shape; needed only with ``sharded_dims_offsets``
            where it cannot be inferred from the even split, and then taken
            from the offsets when ``None``.
    """
    g = group_info(grid, tuple(range(grid.ndim)))
    if g.size == 1:  # the one piece, its halos cropped
        return assemble([local], sharding, grid)
    full = shape if shape is not None else _infer_shape(local, sharding, grid)
    shapes = [shard_shape(full, sharding, i, grid) for i in range(grid.size)]
    biggest = [max(s[d] for s in shapes) for d in range(local.dim())]
    padded = torch.zeros(biggest, dtype=local.dtype, device=local.device)
    padded[tuple(slice(0, n) for n in local.shape)] = local
    stacked = _comm.all_gather(padded.unsqueeze(0), 0, g.pg)
    by_member = g.from_group_rank(list(stacked.unbind(0)))
    # members are in linear device order because the group spans every axis.
    pieces = [p[tuple(slice(0, n) for n in s)] for p, s in zip(by_member, shapes, strict=True)]
    return assemble(pieces, sharding, grid)


def _infer_shape(local: torch.Tensor, sharding: Sharding, grid: Grid) -> tuple[int, ...]:
    out = []
    for d in range(local.dim()):
        axes = sharding.split_axes[d] if d < len(sharding.split_axes) else ()
        core = local.shape[d] - sum(sharding.halo(d))
        if axes and sharding.sharded_dims_offsets is not None:
            counts = sharding.shard_counts(grid.shape)
            k = sharding.sharded_dims.index(d)
            out.append(sharding.sharded_dims_offsets[sum(c + 1 for c in counts[:k + 1]) - 1])
        elif axes:
            out.append(core * len(grid.members(axes)))
        else:
            out.append(core)
    return tuple(out)
