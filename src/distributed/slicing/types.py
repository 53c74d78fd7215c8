"""Enums and records of the tensor slicing module."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from ..comm.reductions import Reduction
from ..shard import Sharding


class SlicingStrategy(str, enum.Enum):
    """How a tensor is cut.

    ROW splits dim 0 (data parallelism), COLUMN dim 1 (model parallelism),
    BLOCK dims 0 and 1 on a 2-D grid, BATCH the batch dim (``batch_axis``,
    0 by default), CUSTOM one dim at user-given split points.
    """

    ROW = "row"
    COLUMN = "column"
    BLOCK = "block"
    BATCH = "batch"
    CUSTOM = "custom"


class ReduceOperation(str, enum.Enum):
    """How a partition's slices are combined by a gather: put back in place, or reduced.

    The element-wise members name a :class:`~torchtp.comm.reductions.Reduction`
    (``MEAN`` is its ``AVERAGE``), torchtp's one reduction enum.
    """

    CONCAT = "concat"
    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"

    @property
    def reduction(self) -> Reduction | None:
        """The element-wise reduction, or ``None`` for ``CONCAT``."""
        if self is ReduceOperation.CONCAT:
            return None
        return Reduction.AVERAGE if self is ReduceOperation.MEAN else Reduction(self.value)


@dataclass(frozen=True)
class SlicingConfig:
    """Defaults of a :class:`~torchtp.slicing.TensorSlicingModule`.

    Attributes:
        num_devices: Devices slices are assigned to (slice ``i`` on device ``i % num_devices``);
            also the default number of slices.
        default_strategy: Strategy when ``slice_tensor`` gets none.
        balance_workload: Sizes differ by at most one (the first slices take the
            remainder); ``False`` cuts like ``torch.chunk`` / DTensor ``Shard``
            (equal ceil-sized slices, a smaller or empty tail).
        enable_overlap: Use ``overlap_size`` when ``slice_tensor`` gets no overlap.
        overlap_size: Halo width added on each side of every cut.
        batch_axis: The dim BATCH splits.
    """

    num_devices: int = 1
    default_strategy: SlicingStrategy = SlicingStrategy.ROW
    balance_workload: bool = True
    enable_overlap: bool = False
    overlap_size: int = 0
    batch_axis: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.num_devices, int) or self.num_devices < 1:
            raise ValueError(f"SlicingConfig.num_devices={self.num_devices!r} must be an int >= 1")
        if not isinstance(self.overlap_size, int) or self.overlap_size < 0:
            raise ValueError(f"SlicingConfig.overlap_size={self.overlap_size!r} must be an "
                             "int >= 0")
        object.__setattr__(self, "default_strategy", SlicingStrategy(self.default_strategy))


@dataclass(frozen=True)
class SliceSpec:
    """Where one slice sits in the sliced tensor.

    Attributes:
        index: Slice number within its partition.
        device: Device the slice is assigned to.
        start: First index per dim, halo included.
        stop: One past the last index per dim, halo included.
        core_start: First index per dim of the slice's own (non-overlap) part.
        core_stop: One past the last index per dim of its own part.
    """

    index: int
    device: int
    start: tuple[int, ...]
    stop: tuple[int, ...]
    core_start: tuple[int, ...]
    core_stop: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the slice data, halo included."""
        return tuple(b - a for a, b in zip(self.start, self.stop, strict=True))

    @property
    def region(self) -> tuple[slice, ...]:
        """Index of the slice (halo included) in the full tensor."""
        return tuple(slice(a, b) for a, b in zip(self.start, self.stop, strict=True))

    @property
    def core_region(self) -> tuple[slice, ...]:
        """Index of the slice's own part in the full tensor."""
        return tuple(slice(a, b) for a, b in zip(self.core_start, self.core_stop, strict=True))

    @property
    def core_in_slice(self) -> tuple[slice, ...]:
        """Index of the slice's own part within the slice data."""
        return tuple(slice(c - a, d - a) for a, c, d in
                     zip(self.start, self.core_start, self.core_stop, strict=True))


@dataclass
class TensorPartition:
    """A sliced tensor: its specs, slice data and the sharding that cut it.

    Attributes:
        partition_id: Identifier used by ``get_slice`` / ``gather_partition``.
        strategy: The strategy used.
        shape: Shape of the sliced tensor.
        overlap: Halo width on each side of every cut.
        slices: One :class:`SliceSpec` per slice, in slice order.
        data: The slice data (fresh copies), in slice order.
        sharding: The :class:`torchtp.shard.Sharding` (with offsets) whose
            pieces on ``grid_shape`` are the slices' own parts.
        grid_shape: Grid of slices: ``(n,)``, or ``(rows, cols)`` for BLOCK.
    """

    partition_id: str
    strategy: SlicingStrategy
    shape: tuple[int, ...]
    overlap: int
    slices: list[SliceSpec]
    data: list[Any] = field(repr=False)
    sharding: Sharding
    grid_shape: tuple[int, ...]
