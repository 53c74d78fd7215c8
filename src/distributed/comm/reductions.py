"""The one reduction enum: what torchtp's collectives, the shard dialect and slicing combine with.

``Reduction`` names the element-wise reductions (the MLIR ``shard`` dialect's
``sum``/``max``/``min``/``product``/``average``; the slicing document spells
``average`` as ``MEAN``, see ``slicing.ReduceOperation``). :func:`torch_op`
(over :data:`TORCH_OPS`) is the one map from a reduction to the
``torch.distributed`` op that computes it (``average`` communicates a sum; the
caller divides by the group size). :func:`reduce_stack` applies one
to slices held locally (torch tensors or NumPy arrays), for the slicing
library's gathers.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


class Reduction(str, enum.Enum):
    """Element-wise reductions (``reduction = <max>`` in the shard dialect)."""

    SUM = "sum"
    MAX = "max"
    MIN = "min"
    PRODUCT = "product"
    AVERAGE = "average"

    @classmethod
    def parse(cls, value: str | Reduction) -> Reduction:
        """``value`` as a :class:`Reduction`.

        Raises:
            ValueError: ``value`` names no reduction; the message lists them.
        """
        try:
            return cls(value.value if isinstance(value, Reduction) else value)
        except ValueError:
            names = ", ".join(r.value for r in cls)
            raise ValueError(f"reduction={value!r} is not supported; use one of {names}") from None


# A str enum hashes like its value, so plain strings ("sum") look these up too.
TORCH_OPS: dict[str, Any] = {
    Reduction.SUM: dist.ReduceOp.SUM,
    Reduction.MAX: dist.ReduceOp.MAX,
    Reduction.MIN: dist.ReduceOp.MIN,
    Reduction.PRODUCT: dist.ReduceOp.PRODUCT,
    Reduction.AVERAGE: dist.ReduceOp.SUM,  # the caller divides by the group size
}


TorchOp = dist.ReduceOp.RedOpType  # what torch_op returns


def torch_op(reduction: str | Reduction) -> TorchOp:
    """The ``torch.distributed`` op computing ``reduction`` (``AVERAGE`` sums; callers divide).

    Every collective in torchtp (the TP regions, the shard dialect) asks this
    function, so a reduction means the same torch op everywhere.

    Raises:
        ValueError: ``reduction`` names no reduction; the message lists them.
    """
    try:
        op: dist.ReduceOp.RedOpType = TORCH_OPS[reduction]
    except KeyError:
        Reduction.parse(reduction)  # raises the ValueError naming every reduction
        raise
    return op


def reduce_stack(values: Sequence[Any], reduction: Reduction) -> Any:
    """Reduce equally-shaped slices element-wise (torch tensors or NumPy arrays).

    ``AVERAGE`` of integers is computed in float64 (like NumPy's mean).
    """
    if isinstance(values[0], np.ndarray):
        stacked_np = np.stack(values)
        numpy_ops: dict[Reduction, Callable[..., Any]] = {
            Reduction.SUM: np.sum, Reduction.MAX: np.max, Reduction.MIN: np.min,
            Reduction.PRODUCT: np.prod, Reduction.AVERAGE: np.mean}
        return numpy_ops[reduction](stacked_np, axis=0)
    stacked = torch.stack(list(values))  # (slices, *shape)
    if reduction is Reduction.AVERAGE:
        exact = stacked.is_floating_point() or stacked.is_complex()
        return (stacked if exact else stacked.to(torch.float64)).mean(0)
    torch_ops: dict[Reduction, Callable[[int], torch.Tensor]] = {
        Reduction.SUM: stacked.sum, Reduction.MAX: stacked.amax,
        Reduction.MIN: stacked.amin, Reduction.PRODUCT: stacked.prod}
    return torch_ops[reduction](0)
