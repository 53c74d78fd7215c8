"""Parameter gradients summed over the context-parallel group.

Parameters are replicated over ``cp`` (every rank holds the whole model, or
its TP shard), but each rank's backward covers only its own tokens: the
loss is the sum of every rank's token losses over the global count
(:mod:`torchtp.cp.loss`), so the gradient is the sum over ``cp`` of each
rank's gradient. The sum is one more :class:`~torchtp.layers.grad_sync.GradSync`
of every parameter, after its TP sums (another group; sums over different
groups commute), so it runs where those do: as soon as autograd computes
the gradient, before DDP's averaging over ``dp``, FSDP2's reduce-scatter
(the hooks follow the parameters FSDP2 swaps in) and the optimizer.
"""

from __future__ import annotations

from torch import nn

from ..comm.runtime import ProcessGroup, group_size
from ..layers import grad_sync as _grad_sync


def install(model: nn.Module, group: ProcessGroup | None) -> int:
    """Sum every parameter gradient of ``model`` over ``group`` (idempotent).

    Returns:
        The number of parameter hooks added (0 for a group of one rank).
    """
    if group_size(group) == 1:
        return 0
    _grad_sync.extend_all(model, _grad_sync.GradSync(group=group))
    return _grad_sync.install(model)


def refresh(model: nn.Module, group: ProcessGroup | None, known: int) -> int:
    """:func:`install` again if ``model``'s parameter count is no longer ``known``.

    Parameters added after the wrap (PEFT adapters) compute this rank's tokens'
    part of their gradient like every other; without their own sum it stays a
    part, with the loss still equal (silently wrong). Called by every forward
    or step of a context-parallel model (a count: no collective); ``known=-1``
    installs.

    Returns:
        The parameter count, the next call's ``known``.
    """
    count = sum(1 for _ in model.parameters())
    if count != known:
        install(model, group)
    return count
