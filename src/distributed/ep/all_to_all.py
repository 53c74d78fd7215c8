"""Token dispatch for expert parallelism: rows sent to the ranks that need them, and back.

==================  =====================================  =====================================
operator            forward                                backward
==================  =====================================  =====================================
all_to_all_rows     all-to-all: ``send[j]`` rows to rank   all-to-all of the gradient with the
                    ``j``, ``recv[j]`` rows from it        counts swapped (rows go back home)
==================  =====================================  =====================================

A dispatch (token states to the ranks holding their experts) and its combine
(expert outputs back) are two calls with swapped counts. The counts differ
per rank and per call and must be consistent across ranks (``recv[j]`` here
is rank ``j``'s ``send[me]``): the caller makes sure they are first
(:mod:`torchtp.ep.dispatch` computes them from routes every rank
holds, after comparing a hash of those routes).
With a group of size 1 the rows are returned as they are.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..comm import ops as _comm
from ..comm.group_ref import GroupRef
from ..comm.runtime import ProcessGroup, group_size


class _AllToAllRows(torch.autograd.Function):
    """forward: all-to-all with counts ``(send, recv)``; backward: the same with ``(recv, send)``.

    Each row's gradient belongs to the rank the row came from: sending the
    gradient rows back along the reversed counts delivers exactly that.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int],
                group: ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.recv = send, recv
        ctx.group = GroupRef(group)
        return _comm.all_to_all(x, send, recv, group)

    @staticmethod
    @once_differentiable  # its collectives are not differentiable: no double backward
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _comm.all_to_all(grad, ctx.recv, ctx.send, ctx.group()), None, None, None


def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int],
                    group: ProcessGroup | None) -> torch.Tensor:
    """Exchange rows of ``x`` (dim 0): ``send[j]`` of them to group rank ``j``, in order.

    Args:
        x: ``(sum(send), ...)`` rows, grouped by destination rank.
        send: Rows for each group rank (this rank's own included).
        recv: Rows from each group rank; ``recv[j]`` must be rank ``j``'s ``send[me]``.
        group: The process group.

    Returns:
        ``(sum(recv), ...)``: the rows received, grouped by source rank.
    """
    if group_size(group) == 1:
        return x
    if not (x.requires_grad and torch.is_grad_enabled()):
        return _comm.all_to_all(x, send, recv, group)
    return _AllToAllRows.apply(x, send, recv, group)
