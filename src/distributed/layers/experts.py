"""Tensor parallelism inside a mixture of experts: every expert's intermediate features split.

An HF experts module keeps all of a layer's experts in 3-D parameters
(transformers >= 5): ``gate_up_proj`` ``(E, 2I, H)`` and ``down_proj``
``(E, H, I)`` (``(E, H, 2I)`` and ``(E, I, H)`` when ``is_transposed``).
Split exactly like a dense MLP, each rank keeps, for every expert, its share
of the ``I`` intermediate features: the matching rows of the gate and of the
up half of ``gate_up_proj`` (weight rows, like ``colwise``) and the matching
columns of ``down_proj`` (weight columns, like ``rowwise``). The module's own
forward (any of transformers' experts implementations) then computes this
rank's partial sum of every token's expert output, and **one** all-reduce per
MoE layer (not one per expert) completes it.

The parameters keep their names and stay 3-D (no conversion to
``nn.Linear``): the module keeps its class's forward, and its class becomes
a subclass of it that adds the region operators around that forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..comm.regions import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region
from ..comm.runtime import ProcessGroup
from ..core.layouts import ParamLayout
from .owned import ShardedModule


class ParallelExperts(ShardedModule):
    """Mixin added to an HF experts module holding this rank's share of every expert.

    ``forward(hidden_states (N, H), top_k_index (N, k), top_k_weights (N, k))``:
    the token states and routing weights enter the tensor-parallel region
    (forward: identity; backward: all-reduce of their partial gradients, so
    the router's gradient is the unsharded one on every rank), the class's
    own forward computes this rank's partial output ``(N, H)``, and one
    all-reduce sums it (backward: identity).

    Attributes:
        tp_group: The tensor-parallel group.
        tp_world_size: Ranks the intermediate features are split over.
        tp_rank: This rank.
    """

    tp_group: ProcessGroup | None
    tp_world_size: int
    tp_rank: int

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        x = copy_to_tensor_parallel_region(hidden_states, self.tp_group)  # (N, H)
        # Routers return float32 weights; the expert outputs are multiplied by them in
        # the promoted dtype anyway, so promoting first is exact, and the weights'
        # gradient is then summed over the ranks in that dtype and rounded once, as the
        # unsharded model rounds it.
        dtype = torch.promote_types(hidden_states.dtype, top_k_weights.dtype)
        weights = copy_to_tensor_parallel_region(top_k_weights.to(dtype), self.tp_group)  # (N, k)
        partial = super().forward(x, top_k_index, weights, *args, **kwargs)  # type: ignore[misc]
        return reduce_from_tensor_parallel_region(partial, self.tp_group)  # (N, H), summed


_SUBCLASSES: dict[type, type] = {}


def _parallel_class(cls: type) -> type:
    """``cls`` with :class:`ParallelExperts` in front, one class per experts class.

    Registered in this module's namespace under its name, so pickle finds it.
    """
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(f"Parallel{cls.__name__}", (ParallelExperts, cls),
                   {"__module__": __name__, "__doc__": ParallelExperts.__doc__})
        _SUBCLASSES[cls] = sub
        globals()[sub.__name__] = sub
    return sub


def shard_experts(module: nn.Module, layouts: dict[str, ParamLayout],
                  group: ProcessGroup | None, world_size: int, rank: int) -> nn.Module:
    """Cut ``module``'s expert parameters to this rank's share, in place, and return it.

    Args:
        module: An HF experts module (3-D ``gate_up_proj`` and ``down_proj``).
        layouts: This rank's layout of each split parameter (full shapes checked).
        group: The tensor-parallel group.
        world_size: Its size.
        rank: This rank.

    Returns:
        ``module`` itself, now an instance of ``Parallel<its class>``.
    """
    for name, layout in layouts.items():
        full = getattr(module, name)
        shard = layout.take(full)  # (E, 2I/tp, H) or (E, H, I/tp), a fresh copy
        setattr(module, name, nn.Parameter(shard, requires_grad=full.requires_grad))
    module.__class__ = _parallel_class(type(module))
    module.__dict__.update(tp_layouts=dict(layouts), tp_group=group, tp_world_size=world_size,
                           tp_rank=rank)
    return module
