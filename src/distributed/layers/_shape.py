"""The error for an input whose last dimension does not fit the layer."""

from __future__ import annotations

import torch
from torch import nn


def input_mismatch(layer: nn.Module, x: torch.Tensor, expected: int) -> ValueError | None:
    """Return a ValueError naming expected vs got, or ``None`` if the size is right.

    Args:
        layer: The parallel layer (its ``_name()`` and ``world_size`` are used).
        x: The input that was passed.
        expected: The last-dimension size this rank's forward needs.
    """
    got = x.shape[-1] if x.dim() else None
    if got == expected:
        return None
    return ValueError(
        f"{layer._name()} on rank {layer.rank} of world_size={layer.world_size}: "  # type: ignore[operator]
        f"input last dimension must be {expected}, got {got} (input shape {tuple(x.shape)})")
