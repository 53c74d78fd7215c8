"""Parameter gradients summed over the context-parallel group.

Parameters are replicated over ``cp`` (every rank holds the whole model, or
its TP shard), but each rank's backward covers only its own tokens: the
loss is the sum of every rank's token losses over the global count
(:mod:`torchtp.cp.loss`), so the gradient is the sum over ``cp`` of each
rank's gradient. A hook on each parameter sums it as soon as autograd
computes it, before anything reads ``.grad``: before DDP's averaging over
``dp`` and before the optimizer. These hooks are the parameters' own,
beside any TP sum (:mod:`torchtp.layers.grad_sync`, over another group):
sums over different groups commute.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm import ops as _comm
from ..comm.group_ref import GroupRef
from ..comm.runtime import ProcessGroup

_MARK = "_torchtp_cp_grad_sum"


class _SumOverCP:
    """Backward hook on a parameter: its gradient summed over the cp group."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = GroupRef(group, "a context-parallel gradient hook")

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        return _comm.all_reduce(grad, self.group())


def install(model: nn.Module, group: ProcessGroup | None) -> int:
    """Hook every trainable parameter of ``model`` to sum its gradient over ``group``.

    Idempotent. Returns the number of hooks added (0 for a group of one rank).
    """
    if group is None or torch.distributed.get_world_size(group) == 1:
        return 0
    added = 0
    for param in model.parameters():
        if not param.requires_grad or getattr(param, _MARK, False):
            continue
        param.register_hook(_SumOverCP(group))
        setattr(param, _MARK, True)
        added += 1
    return added
