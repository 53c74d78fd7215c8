"""A uniform view of Linear-like modules: nn.Linear and transformers' Conv1D.

GPT-2's ``Conv1D`` stores its weight as ``(in_features, out_features)`` and
computes ``x @ W + b``; nn.Linear stores ``(out_features, in_features)``.
The view exposes the checkpoint tensor plus the dims, so styles can split
either one the same way and record that the local weight is transposed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from ..core.layouts import ParamLayout, replicated


@dataclass(frozen=True)
class LinearView:
    """A Linear-like module seen in PyTorch's ``(out, in)`` orientation."""

    in_features: int
    out_features: int
    checkpoint_weight: torch.Tensor
    bias: torch.Tensor | None
    transposed: bool

    def layouts(self, dim: int, segments: tuple[tuple[int, int], ...],
                bias_split: bool = True) -> dict[str, ParamLayout]:
        """Layouts for splitting ``dim`` of the ``(out, in)`` weight into ``segments``.

        Args:
            dim: 0 splits out_features (weight rows), 1 splits in_features (columns).
            segments: Ranges this rank keeps along that dim.
            bias_split: The bias follows the out_features split (True for dim 0).
        """
        full = tuple(self.checkpoint_weight.shape)
        # Conv1D's checkpoint is (in, out): the same logical dim sits at the other index.
        ckpt_dim = (1 - dim) if self.transposed else dim
        out = {"weight": ParamLayout(full, ckpt_dim, segments, self.transposed)}
        if self.bias is not None:
            out["bias"] = (ParamLayout((self.out_features,), 0, segments)
                           if bias_split and dim == 0 else replicated(self.bias.shape))
        return out


def conv1d_type() -> type | None:
    """transformers' ``Conv1D`` class if its module is loaded (no instance exists otherwise).

    Looked up, never imported: planning a model without transformers must not
    import it (transformers is optional, and its import is slow).
    """
    loaded = sys.modules.get("transformers.pytorch_utils")
    conv1d = getattr(loaded, "Conv1D", None) if loaded is not None else None
    return conv1d if isinstance(conv1d, type) else None


def linear_view(module: nn.Module) -> LinearView | None:
    """The module as a :class:`LinearView`, or ``None`` if it is not Linear-like."""
    if isinstance(module, nn.Linear):
        return LinearView(module.in_features, module.out_features, module.weight,
                          module.bias, transposed=False)
    conv1d = conv1d_type()
    if conv1d is not None and isinstance(module, conv1d):
        weight = cast(torch.Tensor, module.weight)
        bias = cast("torch.Tensor | None", module.bias)
        n_in, n_out = weight.shape
        return LinearView(n_in, n_out, weight, bias, transposed=True)
    return None
