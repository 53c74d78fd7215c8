"""Entering the TP region with the input gradient's all-reduce left to the projections.

:func:`~torchtp.comm.regions.copy_to_tensor_parallel_region` all-reduces the
input gradient in its own autograd node, after the backward of every
weight-rows-split projection fed that input has finished: nothing runs beside
the all-reduce. With overlap on (``"grad_reduce"``, :mod:`torchtp.comm.overlap`)
the projections fed one replicated tensor (q/k/v, gate/up: the siblings)
share a :class:`SharedGrad` instead. Each one's backward adds its partial
input gradient ``grad_y W`` ``(..., in)`` to the shared sum; the last one to
run starts the all-reduce of the sum without waiting, computes its own weight
and bias gradients meanwhile, then waits (:mod:`torchtp.layers.linear_grad_reduce`).
The entry node (identity forward, in front of the siblings) then passes the
reduced sum on. Still one all-reduce per input, the same as without overlap.
Under sequence parallelism the entry is the all-gather of the block's input
and the reduction a reduce-scatter (:mod:`torchtp.comm.sequence_parallel`).

The entry node is also the safety net: when it runs and the sum was not
reduced (a sibling counted in the forward did not take part in this
backward: its output was unused), it reduces the sum itself, blocking, as the
plain region does. Every rank runs the same graph, so every rank takes the
same path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from ..core import torch_compat as _torch_compat
from . import ops as _comm
from .group_ref import GroupRef
from .runtime import ProcessGroup
from .tensor_memo import TensorMemo

Finish = Callable[[], torch.Tensor]  # waits for a started reduction and returns its result


@dataclass(eq=False)
class SharedGrad:
    """The partial input gradients of the siblings fed one tensor, summed and reduced once.

    The last sibling to run starts the reduction and keeps its result; the
    entry node returns it (:meth:`settle`), so the siblings themselves pass no
    gradient to the entry.

    Attributes:
        start: Starts the reduction of a summed partial (owned, contiguous)
            without waiting; the returned callable waits and gives the result.
        reduce: The same reduction, blocking (the entry node's fallback).
        members: Siblings that registered on this input in the forward.
        seen: Siblings whose backward has run in the current backward pass.
        partial: Their partial input gradients summed so far ``(..., in)``.
        result: The reduced sum, once the last sibling has waited for it.
    """

    start: Callable[[torch.Tensor], Finish]
    reduce: Callable[[torch.Tensor], torch.Tensor]
    members: int = 0
    seen: int = 0
    partial: torch.Tensor | None = None
    result: torch.Tensor | None = None

    def add(self, grad: torch.Tensor) -> Finish | None:
        """Add one sibling's partial input gradient (owned); for the last sibling, start
        the reduction of the sum and return its wait (the caller must call it)."""
        if self.seen == 0:
            # A pass that never reaches the entry node (gradients of weights only) must not
            # leave a half-built sum for the next pass.
            _torch_compat.at_end_of_backward(self.reset)
        self.partial = grad if self.partial is None else self.partial.add_(grad)
        self.seen += 1
        if self.seen < self.members:
            return None
        pending = self.start(self.partial.contiguous())

        def finish() -> torch.Tensor:
            self.result = pending()
            return self.result
        return finish

    def settle(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The entry node's input gradient.

        ``grad`` is what reached the entry from other consumers (none for the
        layers' own entries). With the siblings' sum reduced, that is its
        result (plus ``grad`` reduced); otherwise the sum and ``grad`` are
        reduced here, blocking, as the plain region would.
        """
        out: torch.Tensor | None
        if self.result is not None:
            out = self.result if grad is None else self.result + self.reduce(grad)
        elif self.partial is not None:
            out = self.reduce(self.partial if grad is None else self.partial.add_(grad))
        else:
            out = None if grad is None else self.reduce(grad)
        self.reset()
        return out

    def reset(self) -> None:
        """Ready for the next backward pass through the same graph (``retain_graph``)."""
        self.seen, self.partial, self.result = 0, None, None


def _all_reduce_start(group: GroupRef) -> Callable[[torch.Tensor], Finish]:
    def start(partial: torch.Tensor) -> Finish:
        return _comm.all_reduce_start(partial, group()).wait
    return start


def all_reduce_grads(group: ProcessGroup) -> SharedGrad:
    """A :class:`SharedGrad` whose reduction is the all-reduce of the replicated input's
    gradient (no sequence parallelism)."""
    ref = GroupRef(group)  # the graph of a kept output must not keep the group alive
    return SharedGrad(_all_reduce_start(ref), lambda t: _comm.all_reduce_(t, ref()))


class _EnterShared(torch.autograd.Function):
    """forward: identity; backward: the siblings' reduced sum (see :meth:`SharedGrad.settle`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shared: SharedGrad) -> torch.Tensor:
        ctx.shared = shared
        ctx.set_materialize_grads(False)  # the siblings pass no gradient here
        return x.view_as(x)

    @staticmethod
    @once_differentiable  # its collective is not differentiable: no double backward
    def backward(ctx, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        return ctx.shared.settle(grad), None


# Per group, the last tensor that entered with a SharedGrad: its entry output and the
# SharedGrad. As in regions._LAST_COPY the output is a view of the input and keeps
# it alive until the next call replaces it or forget() drops it.
_LAST: TensorMemo[tuple[torch.Tensor, SharedGrad]] = TensorMemo(last_per_group=True)


def enter_shared(x: torch.Tensor, group: ProcessGroup) -> tuple[torch.Tensor, SharedGrad]:
    """Enter the TP region for one more sibling fed ``x`` (which requires grad).

    Returns:
        The entry node's output (the same for every sibling fed the unmodified
        ``x``) and the :class:`SharedGrad` the sibling's backward adds to; its
        :attr:`~SharedGrad.members` already counts this sibling.
    """
    found = _LAST.get(group, x)
    if found is None:
        shared = all_reduce_grads(group)
        found = (_EnterShared.apply(x, shared), shared)
        _LAST.put(group, x, found)
    found[1].members += 1
    return found


def entered(group: ProcessGroup | None) -> bool:
    """Whether a tensor entered the region of ``group`` since :func:`forget`."""
    return _LAST.holds(group)


def forget() -> None:
    """Drop the entries (see :func:`torchtp.comm.regions.forget_shared_inputs`)."""
    _LAST.clear()
