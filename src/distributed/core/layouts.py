"""Which slice of the full tensor each rank holds: the split rule, the cutter, the layouts.

Everything in torchtp that splits a dimension over ranks asks this module:

* :func:`shard_range` (with :func:`shard_sizes`, :func:`shard_offsets`) - **the
  one split rule**; ``shard.Sharding.offsets`` and ``slicing.split_offsets``
  call it. A size of ``n`` units (rows, columns, heads, KV groups, vocabulary
  ids) is split over ``tp`` ranks *balanced*: every rank gets ``n // tp`` units
  and the first ``n % tp`` ranks one more, so shares differ by at most one
  unit. When ``tp`` divides ``n`` this is the usual equal split. The slicing
  document's ``balance_workload=False`` is the same function's ``rule="ceil"``.
* :func:`cut` - **the one shard cutter**: ``segments`` of a tensor along a
  dimension (layers, styles, checkpoints and the scatter collective use it).
* :func:`valid_sizes` - **the one valid-sizes function**: the tp sizes that give
  every rank at least one unit of every split dimension.
* :class:`ParamLayout` - how one parameter maps onto the full (checkpoint)
  tensor. Parallel layers own theirs (:func:`torchtp.layers.layouts_of`);
  loading reads only ``segments`` of the checkpoint tensor, saving writes them
  back, and resharding recomputes them for another tp size. Segments also
  cover packed projections (one range per fused part) and replicated KV heads
  (several ranks hold the same range).

Why balanced rather than ``torch.chunk`` (which DTensor's ``Shard`` follows,
``ceil(n / tp)`` per rank with the remainder on the last ranks): ``chunk``
gives 97 rows over 4 ranks as 25/25/25/22 and 5 heads over 4 ranks as
2/2/1/0 (an empty rank), while balanced gives 25/24/24/24 and 2/1/1/1. The
largest shard, which sets memory and step time, is never bigger than
``chunk``'s, and no rank is empty while ``tp <= n``. torchtp checkpoints
record every rank's ``(start, length)`` segments, so they do not depend on
the rule (see docs/decisions.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch

MAX_TP = 64  # largest tp size listed by valid_sizes (messages, `torchtp plan`)

Segments = tuple[tuple[int, int], ...]


SplitRule = Literal["balanced", "ceil"]
"""How :func:`shard_range` splits: ``"balanced"`` (torchtp's rule, shares differ by
at most one, the first ``size % parts`` ranks one more) or ``"ceil"``
(``ceil(size / parts)`` each like ``torch.chunk``, a smaller or empty tail; the
slicing document's ``balance_workload=False``)."""


def shard_range(size: int, parts: int, index: int, unit: int = 1,
                rule: SplitRule = "balanced") -> tuple[int, int]:
    """``(start, length)`` of rank ``index``'s share of ``size`` units, in elements.

    The one split rule: every other split in torchtp (:func:`shard_sizes`,
    :func:`shard_offsets`, ``shard.Sharding.offsets``,
    ``slicing.split_offsets``) is this function.

    Args:
        size: Number of units to split (rows, heads, KV groups...).
        parts: Number of ranks.
        index: This rank.
        unit: Elements per unit (e.g. ``head_dim`` rows per head).
        rule: ``"balanced"`` (default) or ``"ceil"``, see :data:`SplitRule`.

    Example:
        >>> shard_range(10, 4, 1), shard_range(10, 4, 3, rule="ceil")
        ((3, 3), (9, 1))
    """
    if rule == "balanced":
        base, extra = divmod(size, parts)
        start, length = index * base + min(index, extra), base + (1 if index < extra else 0)
    elif rule == "ceil":
        step = -(-size // parts)
        start = min(index * step, size)
        length = min(step, size - start)
    else:
        raise ValueError(f"split rule={rule!r} is not supported; use 'balanced' or 'ceil'")
    return start * unit, length * unit


def shard_sizes(size: int, parts: int, rule: SplitRule = "balanced") -> list[int]:
    """Units per rank when ``size`` units are split over ``parts`` ranks (:func:`shard_range`).

    Example:
        >>> shard_sizes(10, 4)
        [3, 3, 2, 2]
    """
    return [shard_range(size, parts, i, rule=rule)[1] for i in range(parts)]


def shard_offsets(size: int, parts: int, rule: SplitRule = "balanced") -> list[int]:
    """Start of every rank's share plus ``size`` (the shard dialect's offsets form).

    Example:
        >>> shard_offsets(10, 4)
        [0, 3, 6, 8, 10]
    """
    return [shard_range(size, parts, i, rule=rule)[0] for i in range(parts)] + [size]


def valid_sizes(*units: int, limit: int = MAX_TP) -> list[int]:
    """The tp sizes in ``1..limit`` that give every rank at least one of each of ``units``.

    Any size at most the smallest of ``units`` works: the split is balanced
    (:func:`shard_sizes`), so no size has to divide.
    """
    top = min([limit, *units])
    return list(range(1, top + 1))


def cut(t: torch.Tensor, dim: int, segments: Sequence[tuple[int, int]]) -> torch.Tensor:
    """``segments`` of ``t`` along ``dim``, concatenated (a view when there is one segment)."""
    parts = [t.narrow(dim, s, n) for s, n in segments]
    if not parts:  # holds nothing along dim (a whole expert that lives on another rank)
        return t.narrow(dim, 0, 0)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


@dataclass(frozen=True)
class ParamLayout:
    """One parameter's placement on this rank.

    Attributes:
        full_shape: Shape of the full tensor as stored in the checkpoint.
        dim: Checkpoint dimension that is split, or ``None`` when replicated.
        segments: ``(start, length)`` ranges along ``dim`` that this rank holds,
            concatenated in order.
        transposed: The local tensor is the transpose of the checkpoint slice
            (GPT-2's Conv1D stores ``(in, out)``; torchtp keeps ``(out, in)``).
        second: A cut along a second dimension, ``(dim, start, length)``, or
            ``None``: expert parallelism times TP inside the experts keeps a
            block (a range of experts along dim 0, its share of every expert's
            features along ``dim``).
    """

    full_shape: tuple[int, ...]
    dim: int | None = None
    segments: Segments = ()
    transposed: bool = False
    second: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        # Readers treat dim=None as replicated, and cut then narrow (or narrow then cut):
        # a second cut needs a first one, along another dimension.
        if self.second is not None and (self.dim is None or self.second[0] == self.dim):
            raise ValueError(f"a layout's second cut {self.second} needs a first cut along "
                             f"another dimension (dim={self.dim})")

    @cached_property
    def saved_shape(self) -> tuple[int, ...]:
        """Shape of this rank's tensor in checkpoint orientation."""
        return held_shape(self.full_shape, self.dim, self.segments, self.second)

    @cached_property  # read by every forward's input check; the layout never changes
    def local_shape(self) -> tuple[int, ...]:
        """Shape of this rank's tensor (in torchtp's orientation)."""
        shape = self.saved_shape
        return tuple(reversed(shape)) if self.transposed else shape

    def record(self) -> tuple[int | None, list[list[int]], list[int] | None]:
        """``(dim, segments, second)`` as JSON-able lists: what checkpoints store and ranks
        exchange (two ranks hold the same numbers exactly when their records are equal)."""
        return (self.dim, [list(s) for s in self.segments],
                None if self.second is None else list(self.second))

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor cut from the full one (a fresh contiguous copy)."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"expected a tensor of shape {self.full_shape}, got {tuple(full.shape)}")
        local = full.detach() if self.dim is None else cut(full.detach(), self.dim, self.segments)
        if self.second is not None:
            local = local.narrow(*self.second)
        if self.transposed:
            local = local.t()
        return local.clone(memory_format=torch.contiguous_format)


def held_shape(full_shape: Sequence[int], dim: int | None, segments: Sequence[Sequence[int]],
               second: Sequence[int] | None = None) -> tuple[int, ...]:
    """Shape (checkpoint orientation) of the part of ``full_shape`` a layout record holds."""
    shape = list(full_shape)
    if dim is not None:
        shape[dim] = sum(n for _, n in segments)
    if second is not None:
        shape[second[0]] = second[2]
    return tuple(shape)


def place(full: torch.Tensor, part: torch.Tensor, dim: int | None,
          segments: Sequence[Sequence[int]], second: Sequence[int] | None = None) -> None:
    """Write ``part`` (checkpoint orientation) where a layout record says it lies in ``full``.

    The inverse of :meth:`ParamLayout.take`; replicated ranges written by several
    ranks hold identical values, so writing them twice is harmless.
    """
    target = full if second is None else full.narrow(*second)
    if dim is None:
        target.copy_(part)
        return
    offset = 0
    for start, n in segments:
        target.narrow(dim, start, n).copy_(part.narrow(dim, offset, n))
        offset += n


def replicated(shape: torch.Size | tuple[int, ...], transposed: bool = False) -> ParamLayout:
    """Layout of a parameter every rank holds whole."""
    full = tuple(reversed(shape)) if transposed else tuple(shape)
    return ParamLayout(full, transposed=transposed)


def split_layout(shape: torch.Size | tuple[int, ...], dim: int, parts: int,
                 index: int) -> ParamLayout:
    """Layout of rank ``index``'s balanced share of ``shape`` along ``dim``."""
    return ParamLayout(tuple(shape), dim, (shard_range(shape[dim], parts, index),))


def group_share(groups: int, per_group: int, parts: int,
                index: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Rank ``index``'s units and groups when ``groups`` groups of ``per_group`` units are split.

    The attention rule: query heads come in KV groups (``per_group`` query
    heads share one KV head) and a rank's query heads must share its KV
    heads. With ``parts <= groups`` every rank gets a balanced share of whole
    groups; with more ranks than groups, the ranks are shared out over the
    groups (balanced) and each group's units are split over its ranks
    (balanced), so the group is replicated on those ranks.

    Returns:
        ``((unit start, unit count), (group start, group count))``.

    Example:
        >>> group_share(2, 7, 4, 1)  # Qwen2-0.5B: 14 heads in 2 KV groups, tp 4
        ((4, 3), (0, 1))
    """
    if parts <= groups:
        start, n = shard_range(groups, parts, index)
        return (start * per_group, n * per_group), (start, n)
    group = next(g for g in range(groups)
                 if index < sum(shard_range(parts, groups, g)))
    first, ranks = shard_range(parts, groups, group)
    start, n = shard_range(per_group, ranks, index - first)
    return (group * per_group + start, n), (group, 1)


def head_share(heads: int, kv_heads: int, parts: int,
               index: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """**The head-boundary rule**: rank ``index``'s query heads and KV heads.

    Every layer that touches heads cuts by this one rule, so their boundaries
    agree: the query/key/value projections' output rows (weight rows), the
    output projection's input columns (weight columns) wherever that layer
    lives, their biases, ALiBi slopes, the local head counts the attention
    module and its KV cache read. It is :func:`group_share` over KV groups
    (``heads // kv_heads`` query heads each).

    Returns:
        ``((first query head, query heads), (first KV head, KV heads))``.

    Example:
        >>> [head_share(4, 4, 3, r)[0] for r in range(3)]  # BERT-base-like 4 heads, tp 3
        [(0, 2), (2, 1), (3, 1)]
    """
    return group_share(kv_heads, heads // kv_heads, parts, index)


def group_ranks(groups: int, parts: int) -> list[list[int]]:
    """The ranks holding each group when there are more ranks than groups (see :func:`group_share`)."""
    out = []
    for g in range(groups):
        first, n = shard_range(parts, groups, g)
        out.append(list(range(first, first + n)))
    return out
