"""``TensorSlicingModule``: the document's async slicing service.

The coroutines run the synchronous functions of
:mod:`torchtp.slicing.functional` in a worker thread (``asyncio.to_thread``)
so large copies never block the event loop, and keep partitions and metrics.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

from .functional import Array, gather, slice_tensor
from .types import GatherOp, ReduceOperation, SlicingConfig, SlicingStrategy, TensorPartition


class UnknownPartitionError(ValueError):
    """A partition id (or a slice index in it) that the module does not hold."""


class TensorSlicingModule:
    """Slice tensors into partitions, serve slices, and gather partitions back.

    Args:
        config: Defaults for strategy, device count, balancing and overlap.

    Example:
        >>> module = TensorSlicingModule(SlicingConfig(num_devices=4))
        >>> await module.initialize()
        >>> part = await module.slice_tensor(x, SlicingStrategy.ROW, num_slices=4)
        >>> full = await module.gather_partition(part.partition_id, ReduceOperation.CONCAT)
    """

    def __init__(self, config: SlicingConfig | None = None):
        self.config = config or SlicingConfig()
        self._partitions: dict[str, TensorPartition] = {}
        self._ids = itertools.count()
        self._ready = False
        self._stats = {"slices": 0, "bytes": 0, "gathers": 0, "slice_s": 0.0, "gather_s": 0.0,
                       "slice_calls": 0}

    async def initialize(self) -> None:
        """Make the module ready; calling it again is harmless."""
        self._ready = True

    async def shutdown(self) -> None:
        """Drop every partition; the module must be initialized again before use."""
        self._partitions.clear()
        self._ready = False

    def _check_ready(self, what: str) -> None:
        if not self._ready:
            raise RuntimeError(f"TensorSlicingModule.{what}: the module is not initialized; "
                               "`await module.initialize()` first")

    async def slice_tensor(self, tensor: Array, strategy: SlicingStrategy | str | None = None,
                           num_slices: int | None = None, overlap: int | None = None,
                           **kw: Any) -> TensorPartition:
        """Cut ``tensor`` and keep the partition.

        Args:
            tensor: NumPy array or torch tensor, any dtype.
            strategy: Default ``config.default_strategy``.
            num_slices: Default ``config.num_devices`` (CUSTOM: from ``split_points``).
            overlap: Default ``config.overlap_size`` when ``config.enable_overlap``, else 0.
            **kw: ``axis``, ``split_points``, ``grid`` as in :func:`torchtp.slicing.plan`.
        """
        self._check_ready("slice_tensor")
        cfg = self.config
        if overlap is None:
            overlap = cfg.overlap_size if cfg.enable_overlap else 0
        pid = f"partition-{next(self._ids)}"
        start = time.perf_counter()
        part = await asyncio.to_thread(
            slice_tensor, tensor, strategy or cfg.default_strategy, num_slices, overlap,
            partition_id=pid, balance=cfg.balance_workload, num_devices=cfg.num_devices,
            batch_axis=cfg.batch_axis, **kw)
        self._stats["slice_s"] += time.perf_counter() - start
        self._stats["slice_calls"] += 1
        self._stats["slices"] += len(part.slices)
        self._stats["bytes"] += sum(_nbytes(d) for d in part.data)
        self._partitions[pid] = part
        return part

    def get_partition(self, partition_id: str) -> TensorPartition:
        """The partition called ``partition_id``."""
        self._check_ready("get_partition")
        try:
            return self._partitions[partition_id]
        except KeyError:
            known = sorted(self._partitions) or "none"
            raise UnknownPartitionError(f"unknown partition id {partition_id!r}; known: "
                                        f"{known}") from None

    def get_slice(self, partition_id: str, index: int) -> Array:
        """Slice ``index`` of a partition (halo included)."""
        part = self.get_partition(partition_id)
        if not 0 <= index < len(part.data):
            raise UnknownPartitionError(f"partition {partition_id!r} has slices "
                                        f"0..{len(part.data) - 1}, not {index}")
        return part.data[index]

    def update_slice(self, partition_id: str, index: int, data: Array) -> None:
        """Replace slice ``index`` (e.g. by a device's result) before a reducing gather."""
        old = self.get_slice(partition_id, index)
        if tuple(data.shape) != tuple(old.shape):
            raise ValueError(f"slice {index} of {partition_id!r} has shape {tuple(old.shape)}; "
                             f"got {tuple(data.shape)}")
        self._partitions[partition_id].data[index] = data

    async def gather_partition(self, partition_id: str,
                               reduce_op: GatherOp | str = ReduceOperation.CONCAT) -> Array:
        """Combine a partition's slices (see :func:`torchtp.slicing.gather`)."""
        part = self.get_partition(partition_id)
        start = time.perf_counter()
        out = await asyncio.to_thread(gather, part, reduce_op)
        self._stats["gather_s"] += time.perf_counter() - start
        self._stats["gathers"] += 1
        return out

    def release_partition(self, partition_id: str) -> None:
        """Forget a partition."""
        self.get_partition(partition_id)
        del self._partitions[partition_id]

    def get_metrics(self) -> dict[str, Any]:
        """The document's metrics: counts, bytes, average times (ms), partitions, devices."""
        s = self._stats
        return {
            "total_slices_created": s["slices"],
            "total_bytes_sliced": s["bytes"],
            "total_gather_operations": s["gathers"],
            "avg_slice_time_ms": 1000 * s["slice_s"] / max(s["slice_calls"], 1),
            "avg_gather_time_ms": 1000 * s["gather_s"] / max(s["gathers"], 1),
            "active_partitions": len(self._partitions),
            "num_devices": self.config.num_devices,
        }


def _nbytes(x: Array) -> int:
    return int(x.nbytes) if hasattr(x, "nbytes") else x.numel() * x.element_size()
