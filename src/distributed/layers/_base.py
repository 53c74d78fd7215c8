"""What both parallel Linear layers share: group resolution, checks, sharded init."""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ..errors import MissingProcessGroupError, launch_hint, valid_sizes
from ..runtime import ProcessGroup, tp_group

M = TypeVar("M", bound=nn.Module)


def resolve_placement(
    who: str, world_size: int | None, rank: int | None, group: ProcessGroup | None
) -> tuple[ProcessGroup | None, int, int]:
    """Return ``(group, world_size, rank)`` for a layer being built.

    ``world_size``/``rank`` default to the group's. Without a running process
    group they default to 1/0, and an explicit ``world_size > 1`` is allowed
    (shards can be built and run as long as no collective is needed).

    Raises:
        ValueError: an explicit ``world_size``/``rank`` contradicts the group, or
            ``rank`` is outside ``0..world_size-1``.
    """
    if group is None:
        group = tp_group()
    if group is not None:
        size, me = dist.get_world_size(group), dist.get_rank(group)
        if world_size is not None and world_size != size:
            raise ValueError(
                f"{who}: world_size={world_size} does not match the process group size {size}; "
                "world_size must match across all ranks: pass world_size=None to use the group's")
        if rank is not None and rank != me:
            raise ValueError(f"{who}: rank={rank} but this process is rank {me} of the group; "
                             "pass rank=None to use the group's")
        return group, size, me
    size = 1 if world_size is None else world_size
    me = 0 if rank is None else rank
    if size < 1:
        raise ValueError(f"{who}: world_size must be >= 1, got {size}")
    if not 0 <= me < size:
        raise ValueError(f"{who}: rank={me} is outside 0..{size - 1} for world_size={size}")
    return None, size, me


def check_divisible(who: str, dim_name: str, value: int, world_size: int, split: str) -> int:
    """Return ``value // world_size`` or raise a ValueError listing the valid sizes.

    Args:
        who: Layer description for the message.
        dim_name: Name of the split dimension, e.g. ``"out_features"``.
        value: Its full size.
        world_size: Number of ranks it is split over.
        split: What is split, e.g. ``"weight rows"``.
    """
    if value % world_size:
        raise ValueError(
            f"{who}: {dim_name} must be divisible by world_size: {dim_name}={value} "
            f"({split}) cannot be split evenly over world_size={world_size}; "
            f"valid world sizes: {valid_sizes(value)}")
    return value // world_size


def require_group(who: str, group: ProcessGroup | None, world_size: int) -> ProcessGroup:
    """Return the group for a needed collective, or raise if there is none."""
    if group is None:
        raise MissingProcessGroupError(
            f"{who} needs a collective across world_size={world_size} ranks, but no process "
            f"group is running; {launch_hint(world_size)}")
    return group


def full_linear(
    in_features: int, out_features: int, bias: bool,
    dtype: torch.dtype | None, device: torch.device | str | None,
) -> nn.Linear:
    """Build the unsharded ``nn.Linear`` a shard is cut from.

    Built exactly as the user would build it, so under the same seed every
    rank draws the same full weight and the shards match ``nn.Linear`` at any
    world size (Megatron's CPU-init approach).
    """
    return nn.Linear(in_features, out_features, bias=bias, dtype=dtype, device=device)


def take_shard(t: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """Copy rank ``rank``'s chunk of ``t`` along ``dim`` into a new tensor."""
    n = t.shape[dim] // world_size
    return t.detach().narrow(dim, rank * n, n).clone(memory_format=torch.contiguous_format)


def new_from_shards(
    cls: type[M], who: str, weight: torch.Tensor, bias: torch.Tensor | None,
    world_size: int | None, rank: int | None, group: ProcessGroup | None, requires_grad: bool,
) -> M:
    """An instance of ``cls`` holding already-cut tensors, without running ``__init__``.

    ``__init__`` would allocate and initialise the parameters only to throw them
    away; the caller still sets the layer's shape attributes.
    """
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    # The parallel layers declare these attributes; nn.Module's own setattr type does not.
    layer.group, layer.world_size, layer.rank = resolve_placement(  # type: ignore[assignment]
        who, world_size, rank, group)
    layer.weight = nn.Parameter(weight, requires_grad=requires_grad)
    layer.bias = None if bias is None else nn.Parameter(  # type: ignore[assignment]
        bias, requires_grad=requires_grad)
    return layer
