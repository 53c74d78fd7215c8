"""Sharded tensor operations with the strategy chosen from the operands' shardings.

Operands are DTensors on a 1-D grid (build them with :func:`distribute`
from a :class:`~torchtp.shard.Sharding`). ``matmul`` implements the
document's strategy table explicitly, so the communication is exactly the
table's; anything else falls back to DTensor's own sharding propagation.

==================================  =================  ==========================
operands (A, B)                      strategy           communication
==================================  =================  ==========================
A Shard(0), B Replicate              ROW_SHARDED        none (result Shard(0))
A Shard(1), B Shard(0)               INNER_SHARDED      one all-reduce (sum)
A Shard(0), B Shard(0)               GATHER_B           one all-gather of B
A Replicate, B Shard(1)              COLUMN_SHARDED     none (result Shard(1))
A Replicate, B Replicate             REPLICATED         none
anything else                        DTENSOR            DTensor decides
==================================  =================  ==========================
"""

from __future__ import annotations

import enum
from typing import cast

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor import distribute_tensor as _distribute_tensor

from .grid import Grid
from .sharding import Sharding


class MatmulStrategy(str, enum.Enum):
    """How :func:`matmul` computes ``A @ B`` (see the module table)."""

    ROW_SHARDED = "row_sharded"
    INNER_SHARDED = "inner_sharded"
    GATHER_B = "gather_b"
    COLUMN_SHARDED = "column_sharded"
    REPLICATED = "replicated"
    DTENSOR = "dtensor"


def placements(sharding: Sharding, grid: Grid) -> list[Placement]:
    """DTensor placements of ``sharding`` on ``grid``: ``Shard(d)`` per split axis, else Replicate.

    Raises:
        ValueError: halos or explicit offsets (DTensor cuts like ``torch.chunk``),
            or a dim split over grid axes in descending order.
    """
    if sharding.halo_sizes is not None or sharding.sharded_dims_offsets is not None:
        raise ValueError("DTensor placements cannot express halo_sizes or sharded_dims_offsets; "
                         "use torchtp.shard.shard for those, or a plain split_axes sharding")
    out: list[Placement] = [Replicate() for _ in range(grid.ndim)]
    for d, axes in enumerate(sharding.split_axes):
        if list(axes) != sorted(axes):
            raise ValueError(f"split_axes[{d}]={list(axes)}: DTensor splits a dim over grid "
                             "axes in ascending order; list them ascending")
        for a in axes:
            sharding.check_grid(grid)
            out[a] = Shard(d)
    return out


def distribute(tensor: torch.Tensor, sharding: Sharding, grid: Grid,
               src: int | None = None) -> DTensor:
    """Place a full ``tensor`` on ``grid`` as ``sharding`` says (a DTensor).

    Args:
        tensor: The full tensor.
        sharding: Even split (DTensor's ``torch.chunk`` layout for uneven sizes).
        grid: The grid (every member calls this).
        src: ``None``: every rank passes the same full tensor and keeps its
            piece, no communication. A grid rank: that rank's tensor is
            scattered/broadcast (the document's "broadcast B once").
    """
    return _distribute_tensor(tensor, grid.dtensor_mesh(), placements(sharding, grid),
                              src_data_rank=src)


def choose_matmul_strategy(a: DTensor, b: DTensor) -> MatmulStrategy:
    """The strategy :func:`matmul` uses for ``a @ b``."""
    if a.device_mesh.ndim != 1 or a.device_mesh != b.device_mesh or a.dim() != 2 or b.dim() != 2:
        return MatmulStrategy.DTENSOR
    table = {
        (Shard(0), Replicate()): MatmulStrategy.ROW_SHARDED,
        (Shard(1), Shard(0)): MatmulStrategy.INNER_SHARDED,
        (Shard(0), Shard(0)): MatmulStrategy.GATHER_B,
        (Replicate(), Shard(1)): MatmulStrategy.COLUMN_SHARDED,
        (Replicate(), Replicate()): MatmulStrategy.REPLICATED,
    }
    return table.get((a.placements[0], b.placements[0]), MatmulStrategy.DTENSOR)


def _wrap(local: torch.Tensor, like: DTensor, placement: Placement,
          shape: tuple[int, ...]) -> DTensor:
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, like.device_mesh, [placement], run_check=False,
                              shape=torch.Size(shape), stride=stride)


def matmul(a: DTensor, b: DTensor, *, reduce: bool = True) -> DTensor:
    """``a @ b`` for sharded operands, communicating only as the strategy table says.

    Args:
        a: ``(m, k)`` DTensor.
        b: ``(k, n)`` DTensor on the same 1-D grid.
        reduce: INNER_SHARDED only: all-reduce the partial products into a
            replicated result (``False`` returns the ``Partial`` sum unreduced).

    Raises:
        ValueError: the inner dimensions differ.
    """
    if a.shape[-1] != b.shape[0]:
        raise ValueError(f"matmul: A {tuple(a.shape)} @ B {tuple(b.shape)}: inner dims "
                         f"{a.shape[-1]} and {b.shape[0]} differ")
    strategy = choose_matmul_strategy(a, b)
    if strategy is MatmulStrategy.DTENSOR:
        return cast(DTensor, a @ b)  # DTensor ops return DTensors; torch's stubs say Tensor
    shape = (a.shape[0], b.shape[1])
    if strategy is MatmulStrategy.GATHER_B:
        b = b.redistribute(b.device_mesh, [Replicate()])  # one all-gather
        strategy = MatmulStrategy.ROW_SHARDED
    # A replicated operand's local gradient is this rank's partial sum (its rows or columns
    # of the other operand only): Partial, as DTensor's own ``a @ b`` leaves it
    a_grad = [Partial("sum")] if strategy is MatmulStrategy.COLUMN_SHARDED else None
    b_grad = [Partial("sum")] if strategy is MatmulStrategy.ROW_SHARDED else None
    local = a.to_local(grad_placements=a_grad) @ b.to_local(grad_placements=b_grad)
    if strategy is MatmulStrategy.INNER_SHARDED:
        partial = _wrap(local, a, Partial("sum"), shape)
        return partial.redistribute(a.device_mesh, [Replicate()]) if reduce else partial
    placement = {MatmulStrategy.ROW_SHARDED: Shard(0), MatmulStrategy.COLUMN_SHARDED: Shard(1),
                 MatmulStrategy.REPLICATED: Replicate()}[strategy]
    return _wrap(local, a, placement, shape)


def sharded_sum(x: DTensor, dim: int | None = None) -> DTensor:
    """Sum of a sharded tensor: local sums plus one all-reduce over the split dim.

    Args:
        x: DTensor on a 1-D grid.
        dim: ``None`` for the total; a dim sums along it (no communication when
            it is not the sharded dim; the result stays sharded).

    Returns:
        A DTensor; replicated unless the sum kept a sharded dim.
    """
    place = x.placements[0] if x.device_mesh.ndim == 1 else None
    if place is None:
        return cast(DTensor, x.sum() if dim is None else x.sum(dim))
    local = x.to_local().sum() if dim is None else x.to_local().sum(dim)
    shape = () if dim is None else tuple(s for i, s in enumerate(x.shape) if i != dim % x.dim())
    if isinstance(place, Shard) and (dim is None or dim % x.dim() == place.dim):
        partial = _wrap(local, x, Partial("sum"), shape)
        return partial.redistribute(x.device_mesh, [Replicate()])  # one all-reduce
    if isinstance(place, Shard):
        kept = place.dim - (1 if place.dim > dim % x.dim() else 0)  # type: ignore[operator]
        return _wrap(local, x, Shard(kept), shape)
    return _wrap(local, x, place, shape)


def sharded_mean(x: DTensor, dim: int | None = None) -> DTensor:
    """Mean of a sharded tensor: :func:`sharded_sum` over the global element count.

    Dividing the global sum by the global count keeps the mean exact for
    uneven shards (a mean of per-shard means would weight small shards too much).
    """
    count = x.numel() if dim is None else x.shape[dim]
    total = sharded_sum(x if x.is_floating_point() else cast(DTensor, x.to(torch.float64)), dim)
    return cast(DTensor, total / count)
