"""Sub-groups of ranks that hold the same replicated head (GQA with tp > KV heads)."""

from __future__ import annotations

import torch.distributed as dist

from ..plans.styles import ShardContext

# Keyed by the TP group object too: a group destroyed and started again in the
# same process gets fresh sub-groups instead of dead ones.
_CACHE: dict[tuple[int, int, int], dist.ProcessGroup | None] = {}


def sharing_subgroup(ctx: ShardContext, units: int) -> dist.ProcessGroup | None:
    """The group of ranks that hold the same one of ``units`` replicated heads.

    With tp = ``units * k`` ranks ``h*k .. h*k+k-1`` share head ``h``. Every
    rank must call this in the same order (all ranks apply the same plan).

    Raises:
        ValueError: the TP group is not the whole world (sub-groups of a
            sub-group are not supported).
    """
    if ctx.group is None or ctx.world_size == 1:
        return None
    if dist.get_world_size(ctx.group) != dist.get_world_size():
        raise ValueError("replicating KV heads (tp > num_key_value_heads) needs the TP group "
                         "to span all ranks; use tp <= num_key_value_heads with a sub-group")
    key = (id(ctx.group), ctx.world_size, units)
    if key not in _CACHE:
        share = ctx.world_size // units
        ranks = [list(range(h * share, (h + 1) * share)) for h in range(units)]
        _CACHE[key], _ = dist.new_subgroups_by_enumeration(ranks)
    return _CACHE[key]
