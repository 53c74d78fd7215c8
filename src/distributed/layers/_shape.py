"""Shapes at the layers: the error for an input that does not fit, rows of a tensor."""

from __future__ import annotations

import math

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


def rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``(N, last)``: every leading dimension flattened into rows.

    Unlike ``reshape(-1, last)`` it is defined when ``t`` has no elements (a
    layer holding none of a whole expert elsewhere: ``last == 0``).
    """
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])
