"""Differentiable collectives for tensor-parallel code.

All functions take ``group=None`` meaning the default TP group (see
:func:`torchtp.comm.runtime.resolve_group`), skip communication when the group has
one rank, and raise :class:`~torchtp.core.errors.MissingProcessGroupError` when the
environment says there are several ranks but no process group was started.

Gradients follow the TP convention of :mod:`torchtp.comm.regions`: computation
after a collective that produces a replicated tensor is replicated, so every
rank holds the full gradient of the same loss for it.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from . import ops as _comm
from .objects import object_device
from .regions import (
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_tensor_parallel_region,
)
from .runtime import ProcessGroup, group_rank, group_size, resolve_group


def all_reduce_sum(tensor: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks; every rank gets the sum.

    forward: all-reduce (sum) into a fresh tensor (``tensor`` is unchanged);
    backward: identity. Assumes what follows is replicated, so each rank
    already holds the full gradient of the sum.

    Args:
        tensor: This rank's addend, any shape; same shape and dtype on all ranks.
        group: Process group; ``None`` for the default TP group.

    Returns:
        The sum, same shape and dtype as ``tensor``.
    """
    return reduce_from_tensor_parallel_region(tensor, resolve_group(group))


def all_gather(
    tensor: torch.Tensor, dim: int = -1, group: ProcessGroup | None = None
) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` (rank order).

    forward: all-gather; backward: each rank keeps its own chunk of the
    gradient. Assumes the gathered tensor is used identically on every rank.

    Args:
        tensor: This rank's shard; the same shape on every rank.
        dim: Dimension to concatenate along.
        group: Process group; ``None`` for the default TP group.

    Returns:
        Tensor whose ``dim`` is ``group size`` times larger.
    """
    return gather_from_tensor_parallel_region(tensor, resolve_group(group), dim)


def reduce_scatter(
    tensor: torch.Tensor, dim: int = -1, group: ProcessGroup | None = None
) -> torch.Tensor:
    """Sum ``tensor`` over ranks and give rank ``r`` the ``r``-th chunk along ``dim``.

    forward: reduce-scatter; backward: all-gather of the chunk gradients (each
    rank's partial input contributed to every chunk).

    Args:
        tensor: This rank's partial sum; ``tensor.shape[dim]`` divisible by the group size.
        dim: Dimension to scatter along.
        group: Process group; ``None`` for the default TP group.

    Raises:
        ValueError: ``tensor.shape[dim]`` is not divisible by the group size.
    """
    g = resolve_group(group)
    size = group_size(g)
    if tensor.shape[dim] % size:
        raise ValueError(f"reduce_scatter: dim {dim} has size {tensor.shape[dim]}, not divisible "
                         f"by the group size {size}; pad it to a multiple of {size}")
    return reduce_scatter_to_tensor_parallel_region(tensor, g, dim)


class _Broadcast(torch.autograd.Function):
    """forward: copy ``src``'s tensor to every rank; backward: gradient to ``src`` only.

    The broadcast value is replicated, so every rank holds the full gradient;
    ``src``'s input receives it unchanged and the other inputs (which did not
    affect the result) receive zeros.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, src: int, group: ProcessGroup) -> torch.Tensor:
        ctx.is_src = group_rank(group) == src
        return _comm.broadcast(x, src, group)

    @staticmethod
    @once_differentiable  # its collectives are not differentiable: no double backward
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return (grad if ctx.is_src else torch.zeros_like(grad)), None, None


def broadcast_tensor(
    tensor: torch.Tensor, src: int = 0, group: ProcessGroup | None = None
) -> torch.Tensor:
    """Return rank ``src``'s ``tensor`` on every rank.

    forward: broadcast into a fresh tensor; backward: ``src`` gets the gradient,
    other ranks zeros. Every rank must pass a tensor of the same shape and dtype.

    Args:
        tensor: The value on ``src``; a same-shaped placeholder elsewhere.
        src: Source rank within ``group``.
        group: Process group; ``None`` for the default TP group.

    Raises:
        ValueError: ``src`` is not a rank of the group.
    """
    g = resolve_group(group)
    size = group_size(g)
    if not 0 <= src < size:
        raise ValueError(f"broadcast_tensor: src={src} is not a rank of the group "
                         f"(group size {size}); use 0..{size - 1}")
    if size == 1:
        return tensor
    return _Broadcast.apply(tensor, src, g)


def synchronize_across_ranks(group: ProcessGroup | None = None) -> None:
    """Block until every rank of the group reaches this call (a barrier).

    A one-value all-reduce agreed like every torchtp collective (``all_reduce:barrier``):
    a rank that calls it alone meets the others' next collective, and every rank raises
    :class:`~torchtp.RankMismatchError` at once instead of waiting out the timeout.
    """
    g = resolve_group(group)
    if group_size(g) > 1:
        _comm.all_reduce_as(torch.zeros(1, device=object_device(g)), g, "sum", "barrier")
