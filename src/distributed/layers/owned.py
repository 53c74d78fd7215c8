"""Which slice of its full parameters a parallel layer holds: the layouts it owns.

Below the layers and the checks alike: :mod:`torchtp.layers.ddp_guard` reads the
layouts of whatever module DDP is given, while the layers call
:func:`torchtp.layers.ddp_guard.install` when they are first built over a group.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..comm.runtime import ProcessGroup, group_size
from ..core.layouts import ParamLayout


class ShardedModule:
    """Mixin of every module that holds a slice of its full parameters.

    ``tp_layouts`` maps each split parameter's name to its
    :class:`~torchtp.core.layouts.ParamLayout`; parameters not listed are
    replicated. The module sets it when it is built and owns it from then on;
    everyone else reads it through :func:`layouts_of`.
    """

    tp_layouts: dict[str, ParamLayout]


def layouts_of(module: nn.Module) -> dict[str, ParamLayout]:
    """Which slice of the full tensor each of ``module``'s own parameters holds.

    Returns:
        ``{parameter name: ParamLayout}`` for the split parameters of a parallel
        layer (empty for any other module: its parameters are replicated).
    """
    # The layer's own dict (not a copy): callers may cache by identity; never mutate it.
    return module.tp_layouts if isinstance(module, ShardedModule) else {}


def accept_full_size(module: nn.Module) -> None:
    """Make ``module`` (a layer holding slices) load a full-size tensor (checkpoint
    orientation) for a split parameter as this rank's slice of it: a state dict of the
    unsharded model, or PEFT's ``modules_to_save`` copy of the layer saved whole, loads
    as it is. A public load pre-hook, registered once; a deep copy of the module (PEFT's
    copy) keeps it."""
    if not getattr(module, "tp_loads_full_size", False):
        module.register_load_state_dict_pre_hook(_take_slices)
        module.tp_loads_full_size = True  # type: ignore[assignment]


def _take_slices(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                 *args: Any) -> None:
    """Load pre-hook of :func:`accept_full_size` (``load_state_dict`` hands every module
    its own copy of the dict)."""
    for name, layout in layouts_of(module).items():
        full = state_dict.get(prefix + name)
        if isinstance(full, torch.Tensor) and tuple(full.shape) == layout.full_shape \
                and tuple(full.shape) != layout.local_shape:
            state_dict[prefix + name] = layout.take(full)


def split_group(modules: Iterable[nn.Module]) -> ProcessGroup | None:
    """The process group ``modules``' parallel layers are split over, or ``None``: none is.

    The largest such group: expert layers placed in blocks of a TP group
    (``expert_parallel=k``) may also name a smaller one.
    """
    groups = {id(g): g for m in modules
              if layouts_of(m) and (g := getattr(m, "group", None)) is not None}
    return max(groups.values(), key=group_size, default=None)


_SUBCLASSES: dict[tuple[type, type], type] = {}


def with_mixin(mixin: type, cls: type, prefix: str) -> type:
    """``cls`` with ``mixin`` in front (``<prefix><cls name>``), one class per pair.

    Registered in the mixin's module under its name, so pickle finds it.
    """
    sub = _SUBCLASSES.get((mixin, cls))
    if sub is None:
        sub = type(f"{prefix}{cls.__name__}", (mixin, cls),
                   {"__module__": mixin.__module__, "__doc__": mixin.__doc__ or cls.__doc__})
        _SUBCLASSES[(mixin, cls)] = sub
        setattr(sys.modules[mixin.__module__], sub.__name__, sub)
    return sub


def hold_shards(module: nn.Module, layouts: dict[str, ParamLayout]) -> nn.Module:
    """Cut ``module``'s own parameters named in ``layouts`` to this rank's slices, in place.

    The module keeps its class's forward (a state-space mixer's, a depthwise
    convolution's): what changes is which slice its parameters hold, so the
    module becomes an instance of ``Sharded<its class>`` owning ``layouts``.

    Returns:
        ``module`` itself.
    """
    for name, layout in layouts.items():
        full = getattr(module, name)
        setattr(module, name, nn.Parameter(layout.take(full), requires_grad=full.requires_grad))
    module.__class__ = with_mixin(ShardedModule, type(module), "Sharded")
    module.__dict__["tp_layouts"] = dict(layouts)
    return module
