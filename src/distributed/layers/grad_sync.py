"""Gradients that must be summed over ranks after backward, recorded as data.

Some replicated parameters receive only a partial gradient on each rank:
KV heads replicated across ranks (each rank's gradient covers its own query
heads), per-head norms applied to a rank's heads only (Qwen3's q_norm),
sequence-parallel norms and biases (each rank sees its own tokens) and LoRA
adapters of split layers. Styles record what to sum in
``module.tp_grad_sync``; :func:`install` registers the gradient hooks.

A hook belongs to a Parameter object, and parameters get replaced: loaders
swap in new ones, and FSDP2 puts an unsharded Parameter on the module for
forward and backward (``fully_shard``) in place of its sharded DTensor one.
So :func:`install` also registers a forward pre-hook on each owning module
that hooks whatever Parameter the module holds when it runs. The gradient of
that Parameter is then summed over the TP (sub)group before anything reads
it: before DDP's averaging and before FSDP2's reduce-scatter over the DP
mesh (FSDP2 reads ``.grad`` of the unsharded parameter after the autograd
engine accumulated it), so both sums together give the global gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..comm import ops as _comm
from ..comm.group_ref import WeakGroup
from ..comm.runtime import ProcessGroup
from ..core import torch_compat as _torch_compat


@dataclass(frozen=True)
class GradSync:
    """Sum a parameter's gradient over ``group``: whole, or only local ``rows``."""

    group: WeakGroup[ProcessGroup | None] = WeakGroup(required=True)  # held weakly (comm.group_ref)
    rows: tuple[int, int] | None = None  # (start, count) along dim 0 of the local tensor


def mark(module: nn.Module, param: str, syncs: tuple[GradSync, ...]) -> None:
    """Record that ``module.<param>``'s gradient needs ``syncs``."""
    current = dict(getattr(module, "tp_grad_sync", {}))
    current[param] = syncs
    module.tp_grad_sync = current  # type: ignore[assignment]


def extend_all(model: nn.Module, sync: GradSync) -> None:
    """Record one more sum, after any recorded, for every parameter of ``model``.

    For a dimension whose ranks all hold every parameter but compute on
    different data (context parallelism: different tokens). Its sum is over
    another group than the TP sums, and sums over different groups commute.
    Parameters already hooked get a hook for the new sum only at the next
    :func:`install`. Idempotent: a sum already recorded is not added again.
    """
    for module in model.modules():
        for name, _param in module.named_parameters(recurse=False):
            syncs = getattr(module, "tp_grad_sync", {}).get(name, ())
            if sync not in syncs:
                mark(module, name, (*syncs, sync))


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

    Also registers, once per owning module, a forward pre-hook that hooks the
    Parameter objects the module holds at each forward (FSDP2's unsharded
    parameters, parameters a loader replaced). Idempotent.

    Returns:
        Number of parameter hooks newly registered (0 when all are in place already).
    """
    added = 0
    for module in model.modules():
        if not getattr(module, "tp_grad_sync", None):
            continue
        added += _hook_parameters(module)
        if not module.__dict__.get("_torchtp_grad_sync_follow"):
            module.register_forward_pre_hook(_follow)
            module.__dict__["_torchtp_grad_sync_follow"] = True
    return added


def _follow(module: nn.Module, _args: Any) -> None:
    """Forward pre-hook: hook the Parameters ``module`` holds now (FSDP2 swaps them in)."""
    if not torch.compiler.is_compiling():
        _hook_parameters(module)
    elif _unhooked(module):  # traced: costs nothing once every Parameter is hooked
        _hook_parameters_eagerly(module)  # a graph break, only until they are


def _unhooked(module: nn.Module) -> bool:
    """Traceable by dynamo: whether a Parameter carries no sum hook at all."""
    for name in getattr(module, "tp_grad_sync", {}):
        param = getattr(module, name, None)
        if param is not None and getattr(param, "_torchtp_grad_sync", None) is None:
            return True
    return False


@_torch_compat.eager_when_compiled
def _hook_parameters_eagerly(module: nn.Module) -> None:
    _hook_parameters(module)


def _hook_parameters(module: nn.Module) -> int:
    added = 0
    for name, syncs in getattr(module, "tp_grad_sync", {}).items():
        param = getattr(module, name, None)
        # ==, not is: a Parameter tied between modules that record equal syncs is
        # hooked once (each forward pre-hook would otherwise add another sum).
        current = getattr(param, "_torchtp_grad_sync", None) if param is not None else None
        if param is None or current == syncs:
            continue
        if current is not None and syncs[:len(current)] == current:  # sums added later
            param.register_hook(_SumHook(syncs[len(current):]))
            param._torchtp_grad_sync = syncs
            added += 1
            continue
        if current is not None:  # its other hook would sum too: neither sum alone is right
            raise ValueError(
                f"{type(module).__name__}.{name}: this Parameter already sums its gradient "
                f"with {current}, and this module records {syncs} for it (a Parameter tied "
                "between modules that split it differently, or recorded again after "
                "install); tie only parameters that are split alike")
        frozen = not param.requires_grad  # e.g. a base layer under LoRA
        param.requires_grad_(True)  # torch only hooks tensors that require grad;
        param.register_hook(_SumHook(syncs))  # the hook stays when it is unfrozen later
        param.requires_grad_(not frozen)
        param._torchtp_grad_sync = syncs
        added += 1
    return added
