"""``Sharding``: how a tensor is cut over a grid (the dialect's ``shard.sharding``).

``split_axes[d]`` lists the grid axes tensor dim ``d`` is split over (several
axes act as one, linearised row-major in the order listed; ``[]`` keeps the
dim whole). Optional ``halo_sizes`` give each sharded dim ``[lo, hi]`` extra
elements from its neighbours; optional ``sharded_dims_offsets`` give each
sharded dim the start of every shard plus the end of the last (uneven
shards). The two are mutually exclusive, as in the dialect.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core.layouts import shard_offsets
from . import _index
from ._index import Shape
from .grid import Grid

GridLike = Grid | Sequence[int]


@dataclass(frozen=True)
class Sharding:
    """Placement of a tensor on a grid.

    Attributes:
        split_axes: For each tensor dim, the grid axes it is split over.
        halo_sizes: Flattened ``[lo0, hi0, lo1, hi1, ...]``, one pair per sharded dim.
        sharded_dims_offsets: Flattened per sharded dim: every shard's start and
            the end of the last shard (``[0, 2, 5, 9, 14]`` for four shards of 14).
        grid: The grid (or grid shape) this sharding refers to; optional when
            the functions below are given one.
    """

    split_axes: tuple[tuple[int, ...], ...]
    halo_sizes: tuple[int, ...] | None = None
    sharded_dims_offsets: tuple[int, ...] | None = None
    grid: Grid | tuple[int, ...] | None = None

    def __init__(self, split_axes: Sequence[Sequence[int] | int],
                 halo_sizes: Sequence[int] | None = None,
                 sharded_dims_offsets: Sequence[int] | None = None,
                 grid: GridLike | None = None):
        axes = tuple((a,) if isinstance(a, int) else tuple(int(x) for x in a) for a in split_axes)
        object.__setattr__(self, "split_axes", axes)
        object.__setattr__(self, "halo_sizes", None if halo_sizes is None else tuple(halo_sizes))
        offsets = None if sharded_dims_offsets is None else tuple(sharded_dims_offsets)
        object.__setattr__(self, "sharded_dims_offsets", offsets)
        object.__setattr__(self, "grid", grid if isinstance(grid, Grid) or grid is None
                           else tuple(grid))
        self._validate()

    def _validate(self) -> None:
        used = [a for axes in self.split_axes for a in axes]
        if any(a < 0 for a in used) or len(set(used)) != len(used):
            raise ValueError(f"split_axes={self._axes_list()}: each grid axis may split at most "
                             "one tensor dim, once, and axes are >= 0")
        if self.halo_sizes is not None and self.sharded_dims_offsets is not None:
            raise ValueError("Sharding: halo_sizes and sharded_dims_offsets are mutually "
                             "exclusive (as in the shard dialect); give one of them")
        n = len(self.sharded_dims)
        if self.halo_sizes is not None and (len(self.halo_sizes) != 2 * n
                                            or any(h < 0 for h in self.halo_sizes)):
            raise ValueError(f"halo_sizes={list(self.halo_sizes)} needs 2 non-negative values "
                             f"per sharded dim; split_axes={self._axes_list()} shards {n} dim(s), "
                             f"so give {2 * n} values")
        if self.grid is not None:
            self.check_grid(self.grid)

    def _axes_list(self) -> list[list[int]]:
        return [list(a) for a in self.split_axes]

    @property
    def sharded_dims(self) -> list[int]:
        """Tensor dims that are split over at least one grid axis."""
        return [d for d, axes in enumerate(self.split_axes) if axes]

    def check_grid(self, grid: GridLike) -> Shape:
        """Return the grid's shape after checking every split axis exists on it."""
        shape = grid.shape if isinstance(grid, Grid) else _index.check_shape(grid)
        for axes in self.split_axes:
            _index.check_axes(axes, len(shape), "split_axes")
        return shape

    def halo(self, dim: int) -> tuple[int, int]:
        """``(lo, hi)`` halo of tensor ``dim`` (``(0, 0)`` without halos)."""
        if self.halo_sizes is None or dim not in self.sharded_dims:
            return 0, 0
        k = self.sharded_dims.index(dim)
        return self.halo_sizes[2 * k], self.halo_sizes[2 * k + 1]

    def offsets(self, dim: int, dim_size: int, grid_shape: Shape) -> list[int]:
        """Start of each shard of tensor ``dim`` plus the end of the last shard."""
        count = math.prod(grid_shape[a] for a in self.split_axes[dim])
        if self.sharded_dims_offsets is None:
            if dim_size % count:
                raise ValueError(
                    f"tensor dim {dim} of size {dim_size} does not split evenly over grid axes "
                    f"{list(self.split_axes[dim])} ({count} shards of grid {grid_shape}); give "
                    "sharded_dims_offsets for uneven shards or pad to a multiple of "
                    f"{count}")
            # The dialect splits evenly here, where torchtp's one rule gives equal shares.
            return shard_offsets(dim_size, count)
        return self._given_offsets(dim, dim_size, grid_shape)

    def shard_counts(self, grid_shape: Shape) -> list[int]:
        """Number of shards of each sharded dim on a grid of ``grid_shape``."""
        return [math.prod(grid_shape[a] for a in self.split_axes[d]) for d in self.sharded_dims]

    def _given_offsets(self, dim: int, dim_size: int, grid_shape: Shape) -> list[int]:
        assert self.sharded_dims_offsets is not None
        counts = self.shard_counts(grid_shape)
        k = self.sharded_dims.index(dim)
        flat = list(self.sharded_dims_offsets)
        if len(flat) != sum(c + 1 for c in counts):
            raise ValueError(f"sharded_dims_offsets={flat} must hold shards+1 values per sharded "
                             f"dim: {sum(c + 1 for c in counts)} in all for shard counts {counts} "
                             f"on grid {grid_shape}")
        start = sum(c + 1 for c in counts[:k])
        out = flat[start:start + counts[k] + 1]
        if out[0] != 0 or out[-1] != dim_size or any(b < a for a, b in itertools.pairwise(out)):
            raise ValueError(f"sharded_dims_offsets for tensor dim {dim} are {out}: they must "
                             f"start at 0, never decrease and end at the dim size {dim_size}")
        return out


def _resolve(sharding: Sharding, grid: GridLike | None) -> Shape:
    grid = sharding.grid if grid is None else grid
    if grid is None:
        raise ValueError("no grid: pass grid=... or build the Sharding with grid=...")
    return sharding.check_grid(grid)


def _device(grid: GridLike | None, sharding: Sharding,
            device: int | Sequence[int] | None) -> Shape:
    shape = _resolve(sharding, grid)
    if device is None:
        g = sharding.grid if grid is None else grid
        if not isinstance(g, Grid):
            raise ValueError("device=None means this process, which needs a Grid, not a shape")
        return g.process_multi_index()
    if isinstance(device, int):
        return _index.multi_index(device, shape)
    _index.linear_index(device, shape)
    return tuple(device)


def shard_bounds(shape: Sequence[int], sharding: Sharding, device: int | Sequence[int] | None,
                 grid: GridLike | None = None) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``device``'s shard (without halos) in every tensor dim."""
    gshape = _resolve(sharding, grid)
    dev = _device(grid, sharding, device)
    if len(sharding.split_axes) > len(shape):
        raise ValueError(f"split_axes={sharding._axes_list()} has {len(sharding.split_axes)} "
                         f"entries but the tensor has only {len(shape)} dims {tuple(shape)}")
    bounds = []
    for d, size in enumerate(shape):
        axes = sharding.split_axes[d] if d < len(sharding.split_axes) else ()
        if not axes:
            bounds.append((0, size))
            continue
        offs = sharding.offsets(d, size, gshape)
        k = _index.linear_index(_index.in_group_index(dev, axes), _index.sub_shape(gshape, axes))
        bounds.append((offs[k], offs[k + 1]))
    return bounds


def shard_shape(shape: Sequence[int], sharding: Sharding, device: int | Sequence[int] | None,
                grid: GridLike | None = None) -> Shape:
    """Shape of ``device``'s shard of a ``shape`` tensor, halos included (shard.shard_shape)."""
    bounds = shard_bounds(shape, sharding, device, grid)
    return tuple(b - a + sum(sharding.halo(d)) for d, (a, b) in enumerate(bounds))


def shard(tensor: torch.Tensor, sharding: Sharding, grid: GridLike | None = None,
          device: int | Sequence[int] | None = None) -> torch.Tensor:
    """Return ``device``'s piece of the full ``tensor`` (this process when ``None``).

    Halos are copied from the neighbouring data; where they fall outside the
    tensor (the first and last shard) they are zeros. The result is a fresh tensor.
    """
    bounds = shard_bounds(tensor.shape, sharding, device, grid)
    out = torch.zeros(shard_shape(tensor.shape, sharding, device, grid), dtype=tensor.dtype,
                      device=tensor.device)
    src, dst = [], []
    for d, (a, b) in enumerate(bounds):
        lo, hi = sharding.halo(d)
        start, stop = max(a - lo, 0), min(b + hi, tensor.shape[d])
        src.append(slice(start, stop))
        dst.append(slice(start - (a - lo), stop - (a - lo)))
    out[tuple(dst)] = tensor[tuple(src)]
    return out


def assemble(pieces: Sequence[torch.Tensor], sharding: Sharding,
             grid: GridLike | None = None) -> torch.Tensor:
    """Inverse of :func:`shard`: the full tensor from every device's piece.

    Args:
        pieces: One piece per device, in linear (row-major) device order.
        sharding: The sharding the pieces were cut with.
        grid: Grid or grid shape (``sharding.grid`` when ``None``).
    """
    gshape = _resolve(sharding, grid)
    if len(pieces) != math.prod(gshape):
        raise ValueError(f"assemble got {len(pieces)} pieces for a grid {gshape} of "
                         f"{math.prod(gshape)} devices; pass one piece per device")
    shape = _full_shape(pieces, sharding, gshape)
    out = torch.empty(shape, dtype=pieces[0].dtype, device=pieces[0].device)
    for i, piece in enumerate(pieces):
        bounds = shard_bounds(shape, sharding, i, gshape)
        core = tuple(slice(lo, piece.shape[d] - hi) for d, (lo, hi)
                     in enumerate(sharding.halo(d) for d in range(len(shape))))
        out[tuple(slice(a, b) for a, b in bounds)] = piece[core]
    return out


def _full_shape(pieces: Sequence[torch.Tensor], sharding: Sharding, gshape: Shape) -> Shape:
    shape = []
    for d in range(pieces[0].dim()):
        axes = sharding.split_axes[d] if d < len(sharding.split_axes) else ()
        core = pieces[0].shape[d] - sum(sharding.halo(d))
        if not axes:
            shape.append(core)
        elif sharding.sharded_dims_offsets is not None:
            counts = sharding.shard_counts(gshape)
            k = sharding.sharded_dims.index(d)
            shape.append(sharding.sharded_dims_offsets[sum(c + 1 for c in counts[:k + 1]) - 1])
        else:
            shape.append(core * math.prod(gshape[a] for a in axes))
    return tuple(shape)
