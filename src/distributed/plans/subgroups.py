"""Sub-groups of ranks that hold the same replicated head (GQA with tp > KV heads)."""

from __future__ import annotations

import weakref

import torch.distributed as dist

from ..comm.group_ref import GroupRef
from ..comm.runtime import get_tensor_parallel_config
from ..core.layouts import group_ranks
from .styles import ShardContext

# TP group (weak key) -> {(tp size, units): sub-group, held weakly}: nothing here keeps
# a group alive (comm.group_ref), and a group started again gets fresh sub-groups.
_CACHE: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple[int, int], GroupRef]] = (
    weakref.WeakKeyDictionary())


def sharing_subgroup(ctx: ShardContext, units: int) -> dist.ProcessGroup | None:
    """The group of ranks that hold the same one of ``units`` replicated heads.

    The TP ranks are shared out over the heads balanced
    (:func:`torchtp.core.layouts.group_ranks`; with tp = ``units * k`` the TP ranks
    ``h*k .. h*k+k-1`` share head ``h``).
    ``new_subgroups_by_enumeration`` is collective over the whole world, so
    every rank of the world creates the sub-groups of every TP group (all TP
    groups of the ``("dp", "tp")`` mesh), in the same order; all ranks apply
    the same plan.

    Raises:
        ValueError: the TP group is neither the whole world nor a row of the
            mesh from ``init_tensor_parallel(tp_size=...)``.
    """
    if ctx.group is None or ctx.world_size == 1:
        return None
    known = _CACHE.setdefault(ctx.group, {})
    key = (ctx.world_size, units)
    if key not in known or not known[key].alive:
        ranks = [[tp_ranks[i] for i in sharing] for tp_ranks in _all_tp_groups(ctx)
                 for sharing in group_ranks(units, ctx.world_size)]
        known[key] = GroupRef(dist.new_subgroups_by_enumeration(ranks)[0], "a KV-head sub-group")
    return known[key]()


def _all_tp_groups(ctx: ShardContext) -> list[list[int]]:
    """Global ranks of every TP group of the world (this rank's among them)."""
    assert ctx.group is not None
    world = dist.get_world_size()
    if dist.get_world_size(ctx.group) == world:
        return [dist.get_process_group_ranks(ctx.group)]
    mesh = get_tensor_parallel_config().mesh
    if mesh is None or get_tensor_parallel_config().group is not ctx.group:
        raise ValueError(
            "replicating KV heads (tp > num_key_value_heads) needs the TP group to be the "
            f"whole world or the mesh's tp group (a group of {dist.get_world_size(ctx.group)} of "
            f"{world} ranks was given); use init_tensor_parallel(tp_size=...) and its tp_group, "
            "or tp <= num_key_value_heads")
    return [[int(r) for r in row] for row in mesh.mesh.reshape(-1, ctx.world_size).tolist()]
