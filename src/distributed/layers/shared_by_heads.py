"""Parts of an attention that every head reads, when each rank holds some heads.

:class:`HeadShardedRMSNorm`: an RMS norm over every attention head.

OLMo-2 (and OLMo-3, OLMoE, FlexOlmo, MiniMax-M2) normalise the whole output of
``q_proj`` and ``k_proj``, all heads together, before splitting it into heads:
``q_norm = RMSNorm(num_heads * head_dim)``. With the projections split by whole
heads, each rank holds ``(B, T, local_heads * head_dim)``; the mean of squares
is over the full width, so each rank sums the squares of its shard and one
small all-reduce of a ``(B, T, 1)`` tensor gives every rank the total
(:func:`~torchtp.comm.regions.sum_statistic_over_region`: forward and backward
all-reduce). The norm's weight is split like the projection's rows.

:class:`SharedFeaturesEntry`: features every head reads (multi-head latent attention's
rope key, a Mamba mixer's ``dt``/B/C).
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm.group_ref import GroupRef, WeakGroup
from ..comm.regions import copy_to_tensor_parallel_region, sum_statistic_over_region
from ..comm.runtime import ProcessGroup
from ..core.layouts import ParamLayout
from ._base import require_group
from .owned import ShardedModule


def rms_norm_of_shard(x: torch.Tensor, sum_squares: torch.Tensor, weight: torch.Tensor,
                      eps: float, width: int) -> torch.Tensor:
    """``weight * x / sqrt(mean(full ** 2) + eps)`` for this rank's shard ``x`` of ``full``.

    The arithmetic of transformers' ``RMSNorm`` (float32 inside, cast back at the
    end), with the mean of squares of the full width given as a sum.

    Args:
        x: This rank's shard, ``(B, T, local_width)``.
        sum_squares: The sum of squares over the full width, ``(B, T, 1)``, float32.
        weight: This rank's slice of the norm's weight, ``(local_width,)``.
        eps: The norm's epsilon.
        width: The full width (``num_heads * head_dim``).
    """
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(sum_squares / width + eps)  # (B, T, local_width)
    return (weight * h).to(dtype)


class HeadShardedRMSNorm(ShardedModule, nn.Module):
    """An RMS norm over ``width`` features of which this rank holds some whole heads.

    ``forward(x (B, T, local_width)) -> (B, T, local_width)``: the sum of squares
    of the shard, all-reduced over the group (backward: its gradient all-reduced
    too), normalises the shard.

    Args:
        weight: This rank's slice of the weight, ``(local_width,)``.
        eps: The norm's epsilon.
        width: The full width the mean of squares is taken over.
        share: This rank's weight in the sum: ``1 / c`` when its heads are
            replicated on ``c`` ranks (more ranks than KV heads), so every head
            counts once; 1 otherwise.
        group: The tensor-parallel group.
        world_size: Its size (> 1).
        layouts: The weight's layout (which rows of the full weight it holds).
        name: The module's name in the model, for errors.
    """

    group: WeakGroup[ProcessGroup | None] = WeakGroup()  # held weakly (comm.group_ref)

    def __init__(self, weight: nn.Parameter, eps: float, width: int, share: float,
                 group: ProcessGroup | None, world_size: int,
                 layouts: dict[str, ParamLayout], name: str = "norm") -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps
        self.width = width
        self.share = share
        self.group = group
        self.world_size = world_size
        self.tp_layouts = layouts
        self.tp_name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        squares = x.to(torch.float32).pow(2).sum(-1, keepdim=True)  # (B, T, 1)
        if self.share != 1.0:
            squares = squares * self.share
        group = require_group(self.tp_name, self.group, self.world_size)
        total = sum_statistic_over_region(squares, group)
        return rms_norm_of_shard(x, total, self.weight, self.variance_epsilon, self.width)

    def extra_repr(self) -> str:
        return (f"{tuple(self.weight.shape)} of width {self.width}, "
                f"eps={self.variance_epsilon}, share={self.share:g}")


class SharedFeaturesEntry:
    """Forward hook of a replicated projection whose last ``features`` output features every
    head (or channel) reads: they enter the region (forward: identity; backward: all-reduce
    of their gradient).

    Multi-head latent attention's ``kv_a_proj_with_mqa``: its output ``(B, T, kv_lora_rank
    + rope)`` is replicated; the first part reaches the heads through ``kv_b_proj``, whose
    input gradient is summed over the ranks already, but the last ``rope`` features are one
    key shared by every head and go to the attention directly, so each rank's gradient of
    them covers its own heads only. A Mamba mixer's ``x_proj`` (its whole output, the
    ``dt``/B/C every channel reads, summed over the ranks in the forward) likewise.

    Args:
        features: Shared features at the end of the output.
        group: The tensor-parallel group (held weakly).
    """

    def __init__(self, features: int, group: ProcessGroup | None) -> None:
        self.features = features
        self.group = GroupRef(group, "features every head reads")

    def __call__(self, _module: nn.Module, _args: object, out: torch.Tensor) -> torch.Tensor:
        if not (out.requires_grad and torch.is_grad_enabled()):
            return out
        if self.features == out.shape[-1]:
            return copy_to_tensor_parallel_region(out, self.group())
        own, shared = out.split([out.shape[-1] - self.features, self.features], dim=-1)
        return torch.cat([own, copy_to_tensor_parallel_region(shared, self.group())], dim=-1)
