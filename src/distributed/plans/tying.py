"""Tied parameters (e.g. input embeddings and lm_head) stay tied after sharding."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from .resolved import ResolvedPlan
    from .styles import ShardContext

Member = tuple[str, str]  # (module name, parameter name)


def tied_groups(model: nn.Module) -> list[list[Member]]:
    """Groups of (module, parameter) names that share one Parameter object."""
    owners: dict[int, list[Member]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for p_name, p in mod.named_parameters(recurse=False):
            members = owners.setdefault(id(p), [])
            if (mod_name, p_name) not in members:
                members.append((mod_name, p_name))
    return [m for m in owners.values() if len(m) > 1]


def check_ties(model: nn.Module, plan: ResolvedPlan, ctx: ShardContext) -> None:
    """Raise if a tied parameter would be split differently in its modules.

    Raises:
        ValueError: names both modules, their styles and the fix.
    """
    for group in tied_groups(model):
        placements = []
        for mod_name, p_name in group:
            layer = plan.layers.get(mod_name)
            layout = layer.layouts.get(p_name) if layer else None
            placements.append((mod_name, p_name, layer.style if layer else "replicate", layout))
        first = placements[0]
        for other in placements[1:]:
            if other[3] != first[3]:
                raise ValueError(
                    f"{ctx.model_name}: '{first[0]}.{first[1]}' is tied to '{other[0]}.{other[1]}' "
                    f"but the plan splits them differently ({first[2]!r} vs {other[2]!r}) at "
                    f"world_size={ctx.world_size}; give both the same split (e.g. "
                    "'embedding_rowwise' + 'colwise_gather_output', both split the vocabulary) "
                    "or 'replicate' both")


def retie(model: nn.Module, groups: list[list[Member]]) -> None:
    """Point every member of each group at the first member's (new) parameter."""
    for group in groups:
        mod_name, p_name = group[0]
        shared = getattr(model.get_submodule(mod_name), p_name)
        for other_mod, other_p in group[1:]:
            setattr(model.get_submodule(other_mod), other_p, shared)
