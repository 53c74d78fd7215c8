"""Wrapping a model that already carries PEFT LoRA layers.

The plan is found and applied on the model as if it had none: every LoRA
layer is taken out of the tree (its base layer put in its place) before
planning, and put back around the (now parallel) base layer afterwards,
where :func:`torchtp.integrations.peft.convert` shards its adapters like
the base. Nothing here imports PEFT unless PEFT is in use.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from torch import nn

from .guards import after_import


@dataclass
class Detached:
    """A LoRA layer taken out of ``parent.<leaf>`` for planning."""

    parent: nn.Module
    leaf: str
    layer: Any  # a PEFT LoraLayer (an nn.Module)
    name: str = ""  # its path in the wrapped model, for errors


def peft_loaded() -> bool:
    """True when PEFT is imported; then torchtp's PEFT hooks are installed too (once)."""
    if "peft" not in sys.modules:
        return False
    from . import peft

    peft.install()
    return True


def watch_for_peft() -> None:
    """At a wrap with PEFT not imported: install torchtp's PEFT hooks when it is imported.

    ``import peft`` after the wrap, then ``get_peft_model(wrapped.base_model, ...)``,
    would otherwise meet torchtp's layers unregistered: PEFT refuses explicit targets
    (``NoMatchingPeftModuleError``, "not supported") and ``"all-linear"`` leaves them
    out. :func:`~torchtp.integrations.guards.after_import` runs
    :func:`peft_loaded` right after PEFT's own import, so either order works.
    Nothing is imported or changed before the user imports PEFT.
    """
    after_import("peft", peft_loaded)


def detach_adapters(model: nn.Module) -> list[Detached]:
    """Put each LoRA layer's base layer in its place; return what was taken out."""
    if not peft_loaded():  # never imports PEFT (see watch_for_peft for PEFT imported later)
        return []
    from peft.tuners.lora import LoraLayer, ParamWrapper

    found = [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]
    on_parameters = [name for name, m in found if isinstance(m, ParamWrapper)]
    if on_parameters:  # before anything is taken out: the model stays as it was
        raise ValueError(
            f"wrapping a model that carries PEFT LoRA on parameters ('{on_parameters[0]}': "
            "target_parameters, PEFT's ParamWrapper, e.g. transformers v5 MoE experts under "
            "target_modules='all-linear') is not supported: torchtp would split the "
            "parameter under full-size adapters. Wrap the model without adapters, then "
            "call get_peft_model(wrapped.base_model, <the same LoraConfig>): each rank then "
            "keeps its slices of the full-size adapters")
    out = []
    for name, layer in found:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, leaf, layer.get_base_layer())
        out.append(Detached(parent, leaf, layer, name))
    return out


def attach_adapters(detached: list[Detached]) -> None:
    """Put the LoRA layers back around whatever base layer now sits in their place.

    A base that became a torchtp layer gets its adapters sharded like it, a whole
    base torchtp treats per rank (a latent attention's ``kv_a_proj_with_mqa``) its
    adapters treated alike (``peft_shared.py``); a base kept whole otherwise (or a
    failed wrap) gets its LoRA layer back unchanged.
    """
    if not detached:
        return
    from .peft import PARALLEL_LINEARS, convert, refuse_unseen_hooks
    from .peft_shared import convert_shared, treated_per_rank

    for item in detached:
        base = getattr(item.parent, item.leaf)
        refuse_unseen_hooks(base, item.name)  # the same plan, so the same verdict, everywhere
        item.layer.base_layer = base
        setattr(item.parent, item.leaf, item.layer)
        if isinstance(base, PARALLEL_LINEARS):
            convert(item.layer)
        elif treated_per_rank(base):
            convert_shared(item.layer)
