"""A module call's first input and first output, as hooks see them.

A decoder layer takes its hidden states first (positionally, or as
``hidden_states``) and returns them first (a tensor, or the first element of
a tuple that also holds attention weights or a cache). The automatic plan's
probe and the ``reduce_residual`` style read and replace them the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def first_input(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """A module call's first input tensor: its first positional argument, or ``hidden_states``."""
    x = args[0] if args else kwargs.get("hidden_states")
    return x if isinstance(x, torch.Tensor) else None


def first_output(out: object) -> torch.Tensor | None:
    """A module's output tensor, or the first element of the tuple or list it returns."""
    if isinstance(out, (tuple, list)) and out:
        out = out[0]
    return out if isinstance(out, torch.Tensor) else None


def other_outputs(out: object) -> list[torch.Tensor]:
    """The tensors a module returns besides its first output (attention weights...)."""
    if not isinstance(out, (tuple, list)):
        return []
    return [t for t in out[1:] if isinstance(t, torch.Tensor)]


def with_first_output(out: object, first: torch.Tensor) -> object:
    """``out`` with its first output replaced by ``first`` (same container type)."""
    if isinstance(out, torch.Tensor):
        return first
    seq: Any = out  # a tuple, a namedtuple or a list whose first element is a tensor
    rest = list(seq[1:])
    if isinstance(seq, list):
        return [first, *rest]
    return (first, *rest) if type(seq) is tuple else type(seq)(first, *rest)
