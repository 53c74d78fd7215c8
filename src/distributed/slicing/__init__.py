"""torchtp.slicing: cut tensors into slices and gather them back.

:class:`TensorSlicingModule` is the document's async API; :func:`slice_tensor`,
:func:`gather` and :func:`plan` are the synchronous functions under it. Cuts
are :class:`torchtp.shard.Sharding` pieces, so slices line up with the
shard collectives and DTensor placements.

Layer 3, a seed-document core beside ``plans``. May import: ``core``, ``comm``,
``shard``.
"""

from __future__ import annotations

from .functional import block_grid, gather, plan, slice_tensor, split_offsets
from .module import TensorSlicingModule, UnknownPartitionError
from .types import ReduceOperation, SliceSpec, SlicingConfig, SlicingStrategy, TensorPartition

__all__ = [
    "ReduceOperation",
    "SliceSpec",
    "SlicingConfig",
    "SlicingStrategy",
    "TensorPartition",
    "TensorSlicingModule",
    "UnknownPartitionError",
    "block_grid",
    "gather",
    "plan",
    "slice_tensor",
    "split_offsets",
]
