"""The weight-columns-split projection leaving a sequence-parallel block, chunked.

``ColumnParallelLinear`` (weight columns, ``in_features``, split; Megatron's
row-parallel layer) under sequence parallelism multiplies the full sequence
by its columns, giving a partial sum ``(B, T, out)``, and reduce-scatters it
to this rank's sequence shard ``(B, S, out)``. With the ``"sequence"``
overlap on (:mod:`torchtp.comm.overlap`) :class:`_LinearReduceScatter` does
both piece by piece (:func:`torchtp.comm.chunked.matmul_reduce_scatter`), and
its backward all-gathers the output gradient piece by piece while it computes
the input gradient of the previous piece (:func:`torchtp.comm.chunked.all_gather_apply`):

===========  =====================================================================
forward      per piece: rows of ``x W^T`` ``(tp * n, B, out)``, reduce-scatter
             started; the next piece's rows are multiplied while it travels
backward     per piece: all-gather of ``grad_y``'s piece started; ``grad_x`` rows
             ``grad_y W`` of the previous piece meanwhile; then
             ``grad_W = grad_y^T x`` on the gathered ``grad_y`` (one product,
             as the unchunked backward computes it)
===========  =====================================================================

The bias is added by the layer after the reduce-scatter, as on the unchunked path.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..comm.chunked import Product, all_gather_apply, matmul_reduce_scatter
from ..comm.group_ref import GroupRef
from ..comm.runtime import ProcessGroup
from ._shape import rows


class _LinearReduceScatter(torch.autograd.Function):
    """forward: chunked ``reduce_scatter(x W^T)``; backward: chunked all-gather + matmul."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, group: ProcessGroup, dim: int,
                chunks: int) -> torch.Tensor:
        y = matmul_reduce_scatter(x, dim, group, Product(weight), chunks)  # (B, S, out)
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.dim, ctx.chunks, ctx.length = GroupRef(group), dim, chunks, x.shape[dim]
        return y

    @staticmethod
    @once_differentiable  # its collectives are not differentiable: no double backward
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                                   None, None, None]:
        x, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        # Autocast ran the forward product in grad's dtype: so do the gradients.
        products = [Product(weight.to(grad.dtype), transposed=True)] if need_x else []
        full, outs = all_gather_apply(grad, ctx.dim, ctx.group(), ctx.length, products,
                                      ctx.chunks)  # (B, T, out), [(B, T, in/tp)]
        grad_x = outs[0].to(x.dtype) if need_x else None
        grad_w = None
        if need_w:
            full_2d = rows(full)  # (B*T, out)
            x_2d = rows(x).to(grad.dtype)  # (B*T, in/tp)
            grad_w = full_2d.t().mm(x_2d).to(weight.dtype)  # (out, in/tp)
        return grad_x, grad_w, None, None, None


def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group: ProcessGroup,
                          dim: int, chunks: int) -> torch.Tensor:
    """This rank's sequence shard ``(B, S, out)`` of ``sum over ranks of x W^T`` (no bias),
    chunked so each piece's reduce-scatter runs beside the next piece's product.

    Args:
        x: The full sequence's input columns of this rank ``(B, T, in/tp)``.
        weight: This rank's columns ``(out, in/tp)``.
        group: The TP group.
        dim: The sequence dimension.
        chunks: Pieces per sequence shard.
    """
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if not needs_grad:
        return matmul_reduce_scatter(x, dim, group, Product(weight), chunks)
    return _LinearReduceScatter.apply(x, weight, group, dim, chunks)
