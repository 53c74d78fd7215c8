"""Apply a resolved plan: swap every planned module for its TP form, in place."""

from __future__ import annotations

from torch import nn

from ..core.log import logger
from ..layers import grad_sync
from ..layers.owned import accept_full_size, layouts_of
from .attention_local import localize_attention
from .resolved import ResolvedPlan
from .styles import ShardContext
from .tying import retie, tied_groups


def apply_plan(model: nn.Module, resolved: ResolvedPlan, ctx: ShardContext) -> list[str]:
    """Cut this rank's shards as each layer plan says; return the swapped module names.

    After the swap, tied parameters are tied again, attention modules whose
    heads are split read their local head counts, and gradient hooks for
    partially replicated parameters are installed. Every module holding slices
    loads a full-size tensor as its slice (:func:`torchtp.layers.owned.accept_full_size`).
    """
    ties = tied_groups(model)
    swapped = []
    for name, style in resolved.assignments.items():
        layer = resolved.layers[name]
        old = model.get_submodule(name)
        new = style.apply(old, layer, ctx)
        for held in new.modules():  # an unsharded state dict loads as this rank's slices
            if layouts_of(held):
                accept_full_size(held)
        if new is not old:
            parent_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent_name), leaf, new)
        elif not layer.layouts:
            continue  # kept whole (replicate, grad-allreduce)
        swapped.append(name)
        logger.debug("swapped %s: %s -> %s", name, type(old).__name__, new)
    retie(model, ties)
    if resolved.heads:
        localize_attention(model, resolved.heads, ctx)
    if ctx.world_size > 1:  # a sum over one rank is the gradient itself
        grad_sync.install(model)
    return swapped
