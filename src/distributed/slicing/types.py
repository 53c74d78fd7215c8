"""Enums and records of the tensor slicing module."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Final

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


class Concat(str, enum.Enum):
    """The gather that puts every slice back in place (``ReduceOperation.CONCAT``).

    Not a reduction: it combines nothing element-wise, so it is not a
    :class:`~torchtp.comm.reductions.Reduction` member.
    """

    CONCAT = "concat"


GatherOp = Reduction | Concat
"""What ``gather`` accepts: ``Concat.CONCAT`` or an element-wise :class:`Reduction`."""


class ReduceOperation:
    """The slicing document's names for how a gather combines slices.

    Not a second reduction enum: the element-wise members *are*
    :class:`~torchtp.comm.reductions.Reduction` members (``MEAN`` is the document's
    name for ``AVERAGE``, so ``ReduceOperation.MEAN is Reduction.AVERAGE``);
    ``CONCAT`` is :attr:`Concat.CONCAT`.
    """

    CONCAT: Final = Concat.CONCAT
    SUM: Final = Reduction.SUM
    MEAN: Final = Reduction.AVERAGE
    MAX: Final = Reduction.MAX
    MIN: Final = Reduction.MIN

    # The document's value strings (``gather(part, "mean")``), in its order.
    BY_VALUE: Final[dict[str, GatherOp]] = {
        "concat": Concat.CONCAT, "sum": Reduction.SUM, "mean": Reduction.AVERAGE,
        "max": Reduction.MAX, "min": Reduction.MIN}

    @classmethod
    def parse(cls, value: GatherOp | str) -> GatherOp:
        """``value`` (a member above or its document string) as a gather op.

        Raises:
            ValueError: ``value`` is none of them; the message lists the names.
        """
        if isinstance(value, Concat) or (isinstance(value, Reduction)
                                          and value in cls.BY_VALUE.values()):
            return value
        op = cls.BY_VALUE.get(value) if isinstance(value, str) else None
        if op is None:
            names = ", ".join(name.upper() for name in cls.BY_VALUE)
            raise ValueError(f"unknown reduce_op {value!r}; use one of {names}")
        return op

    @staticmethod
    def name_of(op: GatherOp) -> str:
        """The document's name of ``op`` (``MEAN`` for ``Reduction.AVERAGE``)."""
        return "MEAN" if op is Reduction.AVERAGE else op.name


def reduction_of(op: GatherOp) -> Reduction | None:
    """The element-wise reduction of a gather op, or ``None`` for ``CONCAT``."""
    return None if isinstance(op, Concat) else op


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
