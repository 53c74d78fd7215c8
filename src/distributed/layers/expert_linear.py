"""ExpertLinear: one Linear of a hand-written MoE's expert, whole on one rank, absent elsewhere.

Expert parallelism for a router ``nn.Linear`` plus an ``nn.ModuleList`` of
expert MLPs: each expert lives whole on one rank of the TP group (its weight
*rows*, ``out_features``, all on that rank: a dim-0 layout holding every row
there and none elsewhere). The holding rank computes the expert's full output;
every other rank returns an exact zero of the same shape, so a later
``reduce_output``/``reduce_input`` all-reduce of the weighted sum gives every
rank the full sum (:mod:`torchtp.plans.late_reduce`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.regions import copy_to_tensor_parallel_region
from ..comm.runtime import ProcessGroup
from ..core.layouts import ParamLayout
from .owned import ShardedModule


class ExpertLinear(ShardedModule, nn.Module):
    """A Linear held whole by one rank (its output there) or absent (an exact zero).

    forward: ``(..., in_features)`` -> ``(..., out_features)``: ``x W^T + b`` on
    the holding rank, zeros elsewhere; with ``enters`` the input first enters
    the TP region (identity). backward: with ``enters``, the input gradient is
    all-reduced (only the holding rank computes the expert's share of it);
    the parameters' gradients are the full ones on the holding rank. The zero
    of an absent expert is a sum over an empty slice of its input, so it is
    exact even when the input holds inf or NaN, and the input-gradient
    all-reduce runs on every rank in the same order.

    Args:
        weight: ``(out, in)`` on the holding rank, ``(0, in)`` elsewhere.
        bias: ``(out,)`` / ``(0,)`` or ``None``.
        in_features: Input features.
        out_features: Output features (of the full Linear).
        held: This rank holds the expert.
        enters: The input comes from outside the experts (a first projection).
        group: The TP group.
        layouts: The parameters' layouts (dim 0, every row or none).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, in_features: int,
                 out_features: int, held: bool, enters: bool, group: ProcessGroup | None,
                 layouts: dict[str, ParamLayout]) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.held, self.enters, self.group = held, enters, group
        self.tp_layouts = layouts
        self.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., in)`` -> ``(..., out)``: the expert's output here, or zeros."""
        if self.enters:
            x = copy_to_tensor_parallel_region(x, self.group)
        if self.held:
            return F.linear(x, self.weight, self.bias)
        zero = x[..., :0].sum(-1, keepdim=True)  # (..., 1), exactly 0, connected to x
        return zero + x.new_zeros(*x.shape[:-1], self.out_features)  # (..., out)

    def extra_repr(self) -> str:
        where = "held here" if self.held else "held by another rank"
        return (f"in_features={self.in_features}, out_features={self.out_features}, {where}"
                + (", input enters the TP region" if self.enters else ""))
