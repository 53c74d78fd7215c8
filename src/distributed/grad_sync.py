"""Gradients that must be summed over ranks after backward, recorded as data.

Some replicated parameters receive only a partial gradient on each rank:
KV heads replicated across ranks (each rank's gradient covers its own query
heads) and per-head norms applied to a rank's heads only (Qwen3's q_norm).
Styles record what to sum in ``module.tp_grad_sync``; :func:`install`
registers the gradient hooks. Loading replaces Parameter objects (and with
them their hooks), so loaders call :func:`install` again; it is idempotent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import _comm
from .runtime import ProcessGroup


@dataclass(frozen=True)
class GradSync:
    """Sum a parameter's gradient over ``group``: whole, or only local ``rows``."""

    group: ProcessGroup | None
    rows: tuple[int, int] | None = None  # (start, count) along dim 0 of the local tensor


def mark(module: nn.Module, param: str, syncs: tuple[GradSync, ...]) -> None:
    """Record that ``module.<param>``'s gradient needs ``syncs``."""
    current = dict(getattr(module, "tp_grad_sync", {}))
    current[param] = syncs
    module.tp_grad_sync = current  # type: ignore[assignment]


class _SumHook:
    """forward: n/a; backward hook on a parameter: sum its gradient over the sync groups."""

    def __init__(self, syncs: tuple[GradSync, ...]) -> None:
        self.syncs = syncs

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        active = [s for s in self.syncs if s.group is not None]
        if not active:
            return grad
        out = grad.clone()
        for sync in active:
            if sync.rows is None:
                out = _comm.all_reduce(out, sync.group)  # keeps earlier row sums
            else:
                start, n = sync.rows
                out[start:start + n] = _comm.all_reduce(grad[start:start + n], sync.group)
        return out


def install(model: nn.Module) -> int:
    """Register the recorded gradient hooks on ``model``'s current parameters.

    Returns:
        Number of hooks newly registered (0 when all are in place already).
    """
    added = 0
    for module in model.modules():
        for name, syncs in getattr(module, "tp_grad_sync", {}).items():
            param = getattr(module, name, None)
            if param is None or getattr(param, "_torchtp_grad_sync", None) is syncs:
                continue
            frozen = not param.requires_grad  # e.g. a base layer under LoRA
            param.requires_grad_(True)  # torch only hooks tensors that require grad;
            param.register_hook(_SumHook(syncs))  # the hook stays when it is unfrozen later
            param.requires_grad_(not frozen)
            param._torchtp_grad_sync = syncs
            added += 1
    return added
