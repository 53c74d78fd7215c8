"""Index arithmetic of the shard dialect, on grid shapes alone (no processes).

Grids are row-major: the last axis varies fastest, so on a ``(10, 20, 30)``
grid the device ``(1, 2, 3)`` has linear index ``3 + 30*2 + 20*30*1 = 663``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Shape = tuple[int, ...]


def check_shape(shape: Sequence[int], what: str = "grid shape") -> Shape:
    """Return ``shape`` as a tuple of positive ints or raise ``ValueError``."""
    out = tuple(int(s) for s in shape)
    if not out or any(s < 1 for s in out):
        raise ValueError(f"{what} {tuple(shape)} is invalid: every axis needs size >= 1, "
                         "e.g. (2, 2) or (4,)")
    return out


def check_axes(axes: Sequence[int] | None, ndim: int, what: str = "grid_axes") -> tuple[int, ...]:
    """Validate grid ``axes`` (``None`` means all axes, in order) against ``ndim`` axes."""
    if axes is None:
        return tuple(range(ndim))
    if isinstance(axes, int):
        axes = [axes]
    out = tuple(int(a) for a in axes)
    for a in out:
        if not 0 <= a < ndim:
            raise ValueError(f"{what}={list(out)}: axis {a} is out of range for a grid with "
                             f"{ndim} axes; use axes in 0..{ndim - 1}")
    if len(set(out)) != len(out):
        raise ValueError(f"{what}={list(out)} repeats an axis; list each grid axis at most once")
    return out


def linear_index(multi_index: Sequence[int], shape: Sequence[int]) -> int:
    """Row-major linear index of ``multi_index`` in a grid of ``shape``."""
    if len(multi_index) != len(shape):
        raise ValueError(f"multi-index {tuple(multi_index)} has {len(multi_index)} entries but "
                         f"the grid shape {tuple(shape)} has {len(shape)} axes")
    index = 0
    for i, (m, s) in enumerate(zip(multi_index, shape, strict=True)):
        if not 0 <= m < s:
            raise ValueError(f"multi-index {tuple(multi_index)}: entry {i} = {m} is outside "
                             f"grid axis {i} of size {s}; use 0..{s - 1}")
        index = index * s + m
    return index


def multi_index(linear: int, shape: Sequence[int]) -> Shape:
    """Row-major multi-index of ``linear`` in a grid of ``shape``."""
    size = math.prod(shape)
    if not 0 <= linear < size:
        raise ValueError(f"linear index {linear} is outside the grid {tuple(shape)} of "
                         f"{size} devices; use 0..{size - 1}")
    out = []
    for s in reversed(shape):
        out.append(linear % s)
        linear //= s
    return tuple(reversed(out))


def sub_shape(shape: Sequence[int], axes: Sequence[int]) -> Shape:
    """Sizes of ``axes`` of a grid of ``shape`` (the shape of a device group)."""
    return tuple(shape[a] for a in axes)


def group_members(shape: Sequence[int], device: Sequence[int], axes: Sequence[int]) -> list[int]:
    """Linear indices of ``device``'s group along ``axes``, in in-group row-major order.

    The group holds every device that differs from ``device`` only on ``axes``;
    the in-group multi-index is the device's coordinates on ``axes`` in the
    order ``axes`` lists them.
    """
    members = []
    for k in range(math.prod(sub_shape(shape, axes))):
        coords = list(device)
        for a, c in zip(axes, multi_index(k, sub_shape(shape, axes)), strict=True):
            coords[a] = c
        members.append(linear_index(coords, shape))
    return members


def in_group_index(device: Sequence[int], axes: Sequence[int]) -> Shape:
    """``device``'s in-group multi-index for the group along ``axes``."""
    return tuple(device[a] for a in axes)


def neighbors(shape: Sequence[int], device: Sequence[int],
              split_axes: Sequence[int]) -> tuple[int, int]:
    """Linear indices of the previous and next device along ``split_axes`` (-1: none).

    Several split axes act as one axis: their coordinates are linearised
    row-major in the order given, as a tensor dimension split over them is.
    """
    axes = check_axes(split_axes, len(shape), "split_axes")
    linear_index(device, shape)  # validates device
    sub = sub_shape(shape, axes)
    k = linear_index(in_group_index(device, axes), sub)
    out = []
    for step in (-1, 1):
        if not 0 <= k + step < math.prod(sub):
            out.append(-1)
            continue
        coords = list(device)
        for a, c in zip(axes, multi_index(k + step, sub), strict=True):
            coords[a] = c
        out.append(linear_index(coords, shape))
    return out[0], out[1]
