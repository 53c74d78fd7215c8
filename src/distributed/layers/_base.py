"""What the parallel layers share: group resolution, checks, owned layouts."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..comm.runtime import ProcessGroup, resolve_group
from ..core.errors import MissingProcessGroupError, launch_hint
from ..core.layouts import ParamLayout, replicated, split_layout, valid_sizes


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
    group = resolve_group(group)
    if group is not None:
        size, me = dist.get_world_size(group), dist.get_rank(group)
        if world_size is not None and world_size != size:
            raise ValueError(
                f"{who}: world_size={world_size} does not match the process group size {size}; "
                "world_size must match across all ranks: pass world_size=None to use the group's")
        if rank is not None and rank != me:
            raise ValueError(f"{who}: rank={rank} but this process is rank {me} of the group; "
                             "pass rank=None to use the group's")
        if size > 1:  # from now on a DDP around these shards leaves them alone
            from .ddp_guard import install

            install()
        return group, size, me
    size = 1 if world_size is None else world_size
    me = 0 if rank is None else rank
    if size < 1:
        raise ValueError(f"{who}: world_size must be >= 1, got {size}")
    if not 0 <= me < size:
        raise ValueError(f"{who}: rank={me} is outside 0..{size - 1} for world_size={size}")
    return None, size, me


def check_splittable(who: str, dim_name: str, value: int, world_size: int, unit: str) -> None:
    """Raise a ValueError listing the valid sizes unless every rank gets one ``unit``.

    Sizes need not divide: the split is balanced (:func:`torchtp.core.layouts.shard_sizes`).

    Args:
        who: Layer description for the message.
        dim_name: Name of the split dimension, e.g. ``"out_features"``.
        value: Its full size.
        world_size: Number of ranks it is split over.
        unit: What one unit is, e.g. ``"weight row"``.
    """
    if value < world_size:
        raise ValueError(
            f"{who}: {dim_name}={value} cannot give each of world_size={world_size} ranks at "
            f"least one {unit}; valid world sizes: {valid_sizes(value)}")


def require_group(who: str | Callable[[], str], group: ProcessGroup | None,
                  world_size: int) -> ProcessGroup:
    """Return the group for a needed collective, or raise if there is none.

    ``who`` may be a callable (a layer's ``_name``): forwards call this every
    time, and the name is only built for the error.
    """
    if group is None:
        name = who if isinstance(who, str) else who()
        raise MissingProcessGroupError(
            f"{name} needs a collective across world_size={world_size} ranks, but no process "
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


def linear_layouts(in_features: int, out_features: int, bias: bool, dim: int, world_size: int,
                   rank: int) -> dict[str, ParamLayout]:
    """Layouts of rank ``rank``'s balanced share of a ``(out, in)`` Linear split along ``dim``.

    ``dim`` 0 splits weight rows (out_features, the bias follows); 1 splits
    weight columns (in_features, the bias stays whole).
    """
    out = {"weight": split_layout((out_features, in_features), dim, world_size, rank)}
    if bias:
        out["bias"] = (split_layout((out_features,), 0, world_size, rank) if dim == 0
                       else replicated((out_features,)))
    return out
