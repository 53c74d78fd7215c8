"""A linear layer on a sequence-gathered input that saves only the sequence shard.

Under sequence parallelism each attention/MLP block all-gathers its input
``(B, S, d)`` -> ``(B, T, d)`` (:func:`~torchtp.comm.sequence_parallel.gather_for_tensor_parallel`)
and feeds it to its weight-rows-split projections. A plain ``F.linear`` saves
that full ``(B, T, d)`` tensor for its weight gradient, and it does not shrink
with tp. :func:`linear_on_gathered` saves the ``(B, S, d)`` shard instead and
all-gathers it again in the backward, once per block (:class:`~torchtp.comm.sequence_parallel.Regather`),
as Megatron's sequence-parallel linear does. With overlap on
(:mod:`torchtp.comm.overlap`) the backward starts that all-gather before it
computes the input gradient, and the last projection fed the block input
starts the input gradient's reduce-scatter before its weight gradient
(Megatron's overlap of the sequence-parallel backward). Under autocast the shard is
saved in the dtype the product runs in (one copy for all siblings), as a
plain ``F.linear`` saves its cast input, so the re-gather moves that dtype
too. A frozen weight (``requires_grad=False``) saves nothing and needs no
re-gather.

=========================  ========================================================
forward                    ``y = x W^T + b`` on the gathered ``x`` (no collective)
backward                   ``grad_x = grad_y W`` (a partial sum: the gather's backward
                           reduce-scatters it); ``grad_W = grad_y^T x`` with ``x``
                           all-gathered again from the saved shard; ``grad_b = sum grad_y``
=========================  ========================================================
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..comm import overlap as _overlap
from ..comm.grad_reduce import SharedGrad
from ..comm.sequence_parallel import GatheredInput, gathered_source, take_precomputed


class _LinearOnGathered(torch.autograd.Function):
    """forward: ``F.linear`` on the full sequence, saving its shard; backward: see the module."""

    @staticmethod
    def forward(ctx, full: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                source: GatheredInput, shared: SharedGrad | None, overlap: bool,
                precomputed: torch.Tensor | None) -> torch.Tensor:
        # (B, T, out/tp); autocast may pick its dtype. The chunked gather may have
        # computed it already, beside the gather's pieces.
        y = F.linear(full, weight, bias) if precomputed is None else precomputed
        # The shard in the dtype the product ran in (autocast's), as F.linear would
        # save its cast input; a frozen weight needs none (plain autograd saves none).
        shard = source.shard_as(y.dtype) if weight.requires_grad else None  # (B, S, in)
        ctx.save_for_backward(shard, weight)
        ctx.regather, ctx.full_dtype = source.regather, full.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.shared, ctx.overlap = shared, overlap
        return y

    @staticmethod
    @once_differentiable  # the re-gather is not differentiable: no double backward
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        shard, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if need_w and ctx.overlap:  # the shard travels while the input gradient is computed
            ctx.regather.start(shard)
        # Autocast's casts are autograd ops outside a plain F.linear; here the
        # products run in the output's dtype and the gradients are cast back.
        grad_x = grad.matmul(weight.to(grad.dtype)).to(ctx.full_dtype) if need_x else None
        finish = None
        if grad_x is not None and ctx.shared is not None and not grad.requires_grad:
            # (With create_graph, grad_x goes on as on the plain path, see linear_grad_reduce.)
            # Summed with the siblings'; the last one starts the reduce-scatter, which
            # runs beside its weight gradient; the gather's backward passes it on.
            finish, grad_x = ctx.shared.add(grad_x), None
        try:
            grad_2d = grad.reshape(-1, grad.shape[-1])  # (B*T, out/tp)
            grad_w = None
            if need_w:
                full = ctx.regather.full(shard)  # (B, T, in)
                grad_w = grad_2d.t().mm(full.reshape(-1, full.shape[-1]).to(grad.dtype))
                grad_w = grad_w.to(weight.dtype)  # (out/tp, in)
                ctx.regather.release()
            grad_b = grad_2d.sum(0).to(ctx.bias_dtype) if need_b else None
        finally:
            if finish is not None:  # waited for also when the compute raised
                finish()
        return grad_x, grad_w, grad_b, None, None, None, None


def linear_on_gathered(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       overlap: bool | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, saving the shard ``x`` was gathered from.

    Falls back to ``F.linear`` when ``x`` is not the unmodified output of
    :func:`~torchtp.comm.sequence_parallel.gather_for_tensor_parallel` (or its
    shard changed since), when no gradient is needed, and under
    ``torch.compile`` (which saves what its own graph needs). A product the
    chunked gather computed beside its pieces is taken instead of computed
    again (:func:`~torchtp.comm.sequence_parallel.take_precomputed`).

    Args:
        x: The gathered input ``(B, T, in)``.
        weight: ``(out/tp, in)``.
        bias: ``(out/tp,)`` or ``None``.
        overlap: The layer's ``overlap`` setting (:mod:`torchtp.comm.overlap`):
            with ``"grad_reduce"`` on, the backward starts the re-gather before
            it computes the input gradient, and the last projection fed ``x``
            starts the input gradient's reduce-scatter before its weight gradient.
    """
    precomputed = take_precomputed(x, weight, bias)
    source = gathered_source(x) if torch.is_grad_enabled() else None
    if source is None:
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
        if precomputed is not None and not needs_grad:
            return precomputed
        return F.linear(x, weight, bias)
    if weight.requires_grad:
        source.regather.users += 1
    on = _overlap.enabled("grad_reduce", overlap, x.device)
    shared = source.shared if on and x.requires_grad else None
    if shared is not None:
        shared.members += 1
    return _LinearOnGathered.apply(x, weight, bias, source, shared, on, precomputed)
