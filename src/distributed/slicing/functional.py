"""Synchronous slicing API: plan slices, cut a tensor, gather it back.

Cuts go through the sharding core: every plan is a
:class:`torchtp.shard.Sharding` with ``sharded_dims_offsets`` on a grid of
slices, and each slice's own part is that sharding's piece
(:func:`torchtp.shard.shard_bounds`), so the slicing module, the shard
collectives and DTensor-based ops cut tensors the same way. Overlaps widen
every cut by ``overlap`` on each side, clipped at the tensor's edges (no padding).
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from ..comm.reductions import reduce_stack
from ..core.layouts import shard_offsets
from ..shard import Sharding, shard_bounds
from .types import (
    GatherOp,
    ReduceOperation,
    SliceSpec,
    SlicingStrategy,
    TensorPartition,
    reduction_of,
)

Array = Any  # numpy.ndarray or torch.Tensor
E = TypeVar("E", bound=enum.Enum)  # the enums parsed from user strings

def split_offsets(size: int, parts: int, balance: bool = True) -> list[int]:
    """Start of each of ``parts`` slices of ``size`` elements, plus ``size``.

    ``balance=True``: sizes differ by at most one, the first ``size % parts``
    slices one larger. ``False``: ``ceil(size / parts)`` each, like ``torch.chunk``
    and DTensor's ``Shard``, with a smaller (possibly empty) tail. Both are
    :func:`torchtp.core.layouts.shard_range`'s rules, so slices and TP shards agree.
    """
    return shard_offsets(size, parts, "balanced" if balance else "ceil")


def block_grid(num_slices: int) -> tuple[int, int]:
    """The most square ``(rows, cols)`` with ``rows * cols == num_slices`` and rows <= cols."""
    rows = max(r for r in range(1, math.isqrt(num_slices) + 1) if num_slices % r == 0)
    return rows, num_slices // rows


def _check_array(tensor: object) -> tuple[int, ...]:
    if not isinstance(tensor, (np.ndarray, torch.Tensor)):
        raise TypeError(f"slicing needs a numpy.ndarray or torch.Tensor, got "
                        f"{type(tensor).__name__}")
    return tuple(tensor.shape)


def _axes(strategy: SlicingStrategy, ndim: int, axis: int | None, batch_axis: int) -> list[int]:
    wanted = {SlicingStrategy.ROW: [0], SlicingStrategy.COLUMN: [1],
              SlicingStrategy.BLOCK: [0, 1], SlicingStrategy.BATCH: [batch_axis],
              SlicingStrategy.CUSTOM: [0]}[strategy]
    if axis is not None:
        if strategy is SlicingStrategy.BLOCK:
            raise ValueError("axis= does not apply to BLOCK, which always splits dims 0 and 1")
        wanted = [axis]
    for a in wanted:
        if not 0 <= a < ndim:
            raise ValueError(f"strategy {strategy.name} splits dim {a}, but the tensor has "
                             f"{ndim} dim(s); use a tensor with more dims, axis=, or ROW")
    return wanted


def plan(shape: Sequence[int], strategy: SlicingStrategy | str, num_slices: int | None = None,
         overlap: int = 0, *, axis: int | None = None, split_points: Sequence[int] | None = None,
         grid: tuple[int, int] | None = None, balance: bool = True, num_devices: int = 1,
         batch_axis: int = 0) -> tuple[list[SliceSpec], Sharding, tuple[int, ...]]:
    """Plan the slices of a tensor of ``shape`` without touching data.

    Args:
        shape: The tensor's shape.
        strategy: A :class:`SlicingStrategy` (or its value, e.g. ``"row"``).
        num_slices: Number of slices (``None``: ``num_devices``, or
            ``len(split_points) + 1`` for CUSTOM).
        overlap: Halo width added on each side of every cut (>= 0).
        axis: Dim to split instead of the strategy's default (not BLOCK).
        split_points: CUSTOM only: increasing indices in ``(0, size)`` where cuts go.
        grid: BLOCK only: ``(rows, cols)``; default the most square factorisation.
        balance: Sizes differ by at most one (see :func:`split_offsets`).
        num_devices: Slice ``i`` goes to device ``i % num_devices``.
        batch_axis: The dim BATCH splits.

    Returns:
        The slice specs, the sharding that cuts their own parts, and the slice grid.
    """
    strategy = _strategy(strategy)
    shape = tuple(shape)
    dims = _axes(strategy, len(shape), axis, batch_axis)
    if not isinstance(overlap, int) or overlap < 0:
        raise ValueError(f"overlap={overlap!r} must be an int >= 0")
    grid_shape, offsets = _offsets(shape, strategy, dims, num_slices, split_points, grid,
                                   balance, num_devices)
    split_axes: list[list[int]] = [[] for _ in range(max(dims) + 1)]
    for k, d in enumerate(dims):
        split_axes[d] = [k]
    sharding = Sharding(split_axes, sharded_dims_offsets=[o for d in dims for o in offsets[d]])
    specs = []
    for i in range(math.prod(grid_shape)):
        core = shard_bounds(shape, sharding, i, grid_shape)
        wide = [(max(a - overlap, 0), min(b + overlap, n)) if d in dims else (a, b)
                for d, ((a, b), n) in enumerate(zip(core, shape, strict=True))]
        specs.append(SliceSpec(i, i % num_devices, tuple(a for a, _ in wide),
                               tuple(b for _, b in wide), tuple(a for a, _ in core),
                               tuple(b for _, b in core)))
    return specs, sharding, grid_shape


def _parse(kind: type[E], value: E | str, label: str) -> E:
    """``value`` as a member of the enum ``kind``, or a ValueError listing the members."""
    try:
        return kind(value)
    except ValueError:
        names = ", ".join(m.name for m in kind)
        raise ValueError(f"unknown {label} {value!r}; use one of {names}") from None


def _strategy(strategy: SlicingStrategy | str) -> SlicingStrategy:
    return _parse(SlicingStrategy, strategy, "slicing strategy")


def _offsets(shape: tuple[int, ...], strategy: SlicingStrategy, dims: list[int],
             num_slices: int | None, split_points: Sequence[int] | None,
             grid: tuple[int, int] | None, balance: bool,
             num_devices: int) -> tuple[tuple[int, ...], dict[int, list[int]]]:
    if strategy is SlicingStrategy.CUSTOM:
        return _custom_offsets(shape[dims[0]], dims[0], num_slices, split_points)
    if split_points is not None:
        raise ValueError(f"split_points are for CUSTOM only, not {strategy.name}")
    n = num_devices if num_slices is None else num_slices
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"num_slices={n!r} must be an int >= 1")
    counts = list(grid or block_grid(n)) if strategy is SlicingStrategy.BLOCK else [n]
    if math.prod(counts) != n:
        raise ValueError(f"BLOCK grid={tuple(counts)} holds {math.prod(counts)} slices, not "
                         f"num_slices={n}")
    for d, k in zip(dims, counts, strict=True):
        if balance and k > shape[d]:
            raise ValueError(f"cannot cut dim {d} of size {shape[d]} into {k} non-empty "
                             f"slices; use at most {shape[d]} slices")
    return tuple(counts), {d: split_offsets(shape[d], k, balance)
                           for d, k in zip(dims, counts, strict=True)}


def _custom_offsets(size: int, dim: int, num_slices: int | None,
                    split_points: Sequence[int] | None
                    ) -> tuple[tuple[int, ...], dict[int, list[int]]]:
    if split_points is None:
        raise ValueError("CUSTOM slicing needs split_points, e.g. split_points=[100, 300]")
    points = [int(p) for p in split_points]
    if any(not 0 < p < size for p in points) or points != sorted(set(points)):
        raise ValueError(f"split_points={points} must be strictly increasing and inside "
                         f"(0, {size}) for dim {dim} of size {size}")
    if num_slices is not None and num_slices != len(points) + 1:
        raise ValueError(f"num_slices={num_slices} does not match {len(points)} split_points "
                         f"({len(points) + 1} slices); drop num_slices or fix split_points")
    return (len(points) + 1,), {dim: [0, *points, size]}


def _copy(x: Array) -> Array:
    return x.copy() if isinstance(x, np.ndarray) else x.clone()


def slice_tensor(tensor: Array, strategy: SlicingStrategy | str = SlicingStrategy.ROW,
                 num_slices: int | None = None, overlap: int = 0,
                 partition_id: str = "partition-0", **kw: Any) -> TensorPartition:
    """Cut ``tensor`` (NumPy array or torch tensor, any dtype) into a :class:`TensorPartition`.

    Slices are fresh copies (writing to one never changes ``tensor``). Keyword
    arguments are those of :func:`plan`.
    """
    shape = _check_array(tensor)
    specs, sharding, grid_shape = plan(shape, strategy, num_slices, overlap, **kw)
    data = [_copy(tensor[s.region]) for s in specs]
    return TensorPartition(partition_id, _strategy(strategy), shape, overlap, specs, data,
                           sharding, grid_shape)


def gather(partition: TensorPartition,
           reduce_op: GatherOp | str = ReduceOperation.CONCAT) -> Array:
    """Combine a partition's slices.

    CONCAT puts every slice's own part (halo dropped) back in place and
    reproduces the sliced tensor exactly. SUM, MEAN, MAX and MIN reduce the
    slices' own parts element-wise (they must all have one shape); MEAN of
    integers is computed in float64.
    """
    op = ReduceOperation.parse(reduce_op)
    cores = [d[s.core_in_slice] for s, d in zip(partition.slices, partition.data, strict=True)]
    reduction = reduction_of(op)
    if reduction is None:
        return _concat(partition, cores)
    shapes = {tuple(c.shape) for c in cores}
    if len(shapes) != 1:
        name = ReduceOperation.name_of(reduction)
        raise ValueError(f"{name} needs slices of one shape, got {sorted(shapes)}; use "
                         "CONCAT, or a slice count that divides the split dims")
    return reduce_stack(cores, reduction)


def _concat(partition: TensorPartition, cores: list[Array]) -> Array:
    # The slices' common dtype, as torch.cat / np.concatenate promote: a slice replaced by
    # update_slice with another dtype neither truncates the others nor is truncated
    first = partition.data[0]
    out: Array
    if isinstance(first, np.ndarray):
        out = np.empty(partition.shape, dtype=np.result_type(*cores))
    else:
        dtype = functools.reduce(torch.promote_types, (c.dtype for c in cores))
        out = torch.empty(partition.shape, dtype=dtype, device=first.device)
    for spec, core in zip(partition.slices, cores, strict=True):
        out[spec.core_region] = core
    return out
