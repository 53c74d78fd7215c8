"""A state-space mixer's gated RMS norm when each rank holds some of its heads.

Mamba-2 (and Falcon-H1, Bamba, Zamba-2, NemotronH: the mixers built the same
way) normalise the scan output ``y`` gated by ``z`` in ``n_groups`` groups of
``intermediate_size / n_groups`` channels each, one group per B/C group of the
scan. With the mixer split by heads (:mod:`torchtp.plans.state_space`) a rank
holds either whole groups (tp <= n_groups): each group's mean of squares is
local and nothing is communicated; or part of one group (more ranks than
groups, ``n_groups = 1`` in most released checkpoints): the group's sum of
squares is summed over the ranks that share it
(:func:`~torchtp.comm.regions.sum_statistic_over_region` over their sub-group:
all-reduce forward and backward, a ``(B, T, 1, 1)`` tensor per call).

:func:`gated_squares` and :func:`finish_gated_norm` are the arithmetic the layer
runs and the plan probe reproduces before anything is cut.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.group_ref import WeakGroup
from ..comm.regions import sum_statistic_over_region
from ..comm.runtime import ProcessGroup
from ..core.layouts import ParamLayout
from ._base import require_group
from .owned import ShardedModule


def gated_squares(x: torch.Tensor, gate: torch.Tensor | None, groups: int,
                  norm_before_gate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 input grouped, and each group's sum of squares on this rank.

    Args:
        x: This rank's channels, ``(..., local_width)``.
        gate: ``z`` for the same channels, or None.
        groups: Groups among this rank's channels (1 for part of a group).
        norm_before_gate: Gate after the norm (Falcon-H1's option); else before.

    Returns:
        ``(h (..., groups, local_width / groups), squares (..., groups, 1))``.
    """
    h = x.to(torch.float32)
    if gate is not None and not norm_before_gate:
        h = h * F.silu(gate.to(torch.float32))
    h = h.reshape(*h.shape[:-1], groups, h.shape[-1] // groups)
    return h, h.pow(2).sum(-1, keepdim=True)


def finish_gated_norm(h: torch.Tensor, squares: torch.Tensor, weight: torch.Tensor,
                      eps: float, group_size: int, gate: torch.Tensor | None, dtype: torch.dtype,
                      norm_before_gate: bool, weight_last: bool) -> torch.Tensor:
    """Normalise ``h`` by its groups' full sums of squares, as transformers' gated norms do.

    Args:
        h: From :func:`gated_squares`, ``(..., groups, width)``.
        squares: Each group's sum of squares over the whole group, ``(..., groups, 1)``.
        weight: This rank's slice of the norm's weight, ``(groups * width,)``.
        eps: The norm's epsilon.
        group_size: Channels of one whole group (the mean's denominator).
        gate: ``z``, or None.
        dtype: The input's dtype (the result is cast back to it).
        norm_before_gate: Gate after the norm.
        weight_last: Multiply by the weight after the cast back (Mamba-2's
            ``MambaRMSNormGated``); else in float32 before it (Falcon-H1's).
    """
    h = h * torch.rsqrt(squares / group_size + eps)
    h = h.reshape(*h.shape[:-2], -1)  # (..., local_width)
    if weight_last:
        return weight * h.to(dtype)
    h = weight * h
    if gate is not None and norm_before_gate:
        h = h * F.silu(gate.to(torch.float32))
    return h.to(dtype)


class GroupShardedGatedRMSNorm(ShardedModule, nn.Module):
    """A gated RMS norm over groups of channels, of which this rank holds some heads.

    ``forward(x (B, T, local_width), gate (B, T, local_width) | None)``: the
    gated input's sum of squares per group, summed over the ranks sharing the
    group when the rank holds part of one, normalises the rank's channels.

    Args:
        weight: This rank's slice of the weight, ``(local_width,)``.
        eps: The norm's epsilon.
        group_size: Channels of one whole group.
        groups: Groups among this rank's channels (1 when it holds part of one).
        norm_before_gate: Gate after the norm (else before).
        weight_last: Weight applied after the cast back to the input dtype.
        group: The sub-group of ranks that share this rank's group, or None
            when the rank holds whole groups.
        sharing: Ranks in that sub-group (1: whole groups, no collective).
        layouts: The weight's layout (which channels of the full weight it holds).
        name: The module's name in the model, for errors.
    """

    group: WeakGroup[ProcessGroup | None] = WeakGroup()  # held weakly (comm.group_ref)

    def __init__(self, weight: nn.Parameter, eps: float, group_size: int, groups: int,
                 norm_before_gate: bool, weight_last: bool, group: ProcessGroup | None,
                 sharing: int, layouts: dict[str, ParamLayout], name: str = "norm") -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps
        self.group_size = group_size
        self.groups = groups
        self.norm_before_gate = norm_before_gate
        self.weight_last = weight_last
        self.group = group
        self.sharing = sharing
        self.tp_layouts = layouts
        self.tp_name = name

    def forward(self, hidden_states: torch.Tensor,
                gate: torch.Tensor | None = None) -> torch.Tensor:
        h, squares = gated_squares(hidden_states, gate, self.groups, self.norm_before_gate)
        if self.sharing > 1:  # part of a group: (B, T, 1, 1) summed over its ranks
            squares = sum_statistic_over_region(
                squares, require_group(self.tp_name, self.group, self.sharing))
        return finish_gated_norm(h, squares, self.weight, self.variance_epsilon,
                                 self.group_size, gate, hidden_states.dtype,
                                 self.norm_before_gate, self.weight_last)

    def extra_repr(self) -> str:
        return (f"{tuple(self.weight.shape)} in {self.groups} group(s) of {self.group_size}, "
                f"eps={self.variance_epsilon}, shared by {self.sharing} rank(s)")
