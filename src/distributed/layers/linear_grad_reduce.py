"""A weight-rows-split linear whose backward overlaps the input-gradient all-reduce.

``RowParallelLinear`` (weight rows, ``out_features``, split; Megatron's
column-parallel layer) sees the full replicated input, so its input gradient
is a partial sum over this rank's output rows and must be all-reduced. With
overlap on (``"grad_reduce"``, :mod:`torchtp.comm.overlap`) its linear is
:class:`_LinearGradReduce`, one autograd node:

===========  ===================================================================
forward      ``y = x W^T + b`` ``(..., out/tp)`` (no collective)
backward     ``grad_x = grad_y W`` ``(..., in)``, added to the siblings' sum
             (:class:`~torchtp.comm.grad_reduce.SharedGrad`); the last sibling
             starts the all-reduce of the sum (``async_op``), then
             ``grad_W = grad_y^T x`` and ``grad_b = sum grad_y`` run while it
             is in flight; then it waits; the region's entry node passes the
             reduced sum on to ``x``
===========  ===================================================================

The products are the ones ``F.linear``'s backward computes, in the same dtype
(autocast's, cast back as autocast's cast nodes would), so outputs and
gradients equal the plain path's; the sum of the siblings' partials is taken
in the order their backwards run, as autograd would take it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..comm.grad_reduce import SharedGrad, enter_shared
from ..comm.runtime import ProcessGroup
from ._shape import rows


class _LinearGradReduce(torch.autograd.Function):
    """forward: ``F.linear``; backward: see the module docstring."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                shared: SharedGrad) -> torch.Tensor:
        y = F.linear(x, weight, bias)  # (..., out/tp); autocast may pick its dtype
        ctx.save_for_backward(x, weight)
        ctx.shared = shared
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    @once_differentiable  # its collective is not differentiable: no double backward
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                                   torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        shared: SharedGrad = ctx.shared
        finish = return_x = None
        if need_x:
            # Partial sum over this rank's output rows, in the input's dtype.
            partial = grad.matmul(weight.to(grad.dtype)).to(x_dtype)  # (..., in)
            if grad.requires_grad:
                # create_graph: pass it on as the plain path does, so that the entry node's
                # all-reduce is marked, as there, as not differentiable twice.
                return_x = partial
            else:
                finish = shared.add(partial)  # the last sibling: the all-reduce is in flight
        try:
            grad_2d = rows(grad)  # (N, out/tp)
            grad_w = grad_b = None
            if need_w:
                x_2d = rows(x).to(grad.dtype)  # (N, in)
                grad_w = grad_2d.t().mm(x_2d).to(w_dtype)  # (out/tp, in)
            if need_b:
                grad_b = grad_2d.sum(0).to(b_dtype)  # (out/tp,)
        finally:
            # Waited for also when the compute raised: the backend holds the buffer.
            if finish is not None:
                finish()  # the entry node passes the result on
        return return_x, grad_w, grad_b, None


def linear_reducing_input_grad(x: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor | None, group: ProcessGroup) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a weight-rows-split layer fed the replicated ``x``
    (which requires grad), entering the TP region with the input-gradient all-reduce
    overlapped with the weight gradient (see the module docstring)."""
    entered, shared = enter_shared(x, group)
    return _LinearGradReduce.apply(entered, weight, bias, shared)
