"""Megatron-style autograd regions: the four operators that make TP exact.

Every operator assumes the computation *outside* the tensor-parallel region is
replicated: each rank holds the same replicated activations and, in backward,
the full gradient of the same loss for them. Inside the region each rank holds
a shard (or a partial sum) and only the gradient of its own part.

With a group of size 1 every operator returns its input untouched. When no
gradient is needed (inference, ``torch.no_grad()``, decode) the forward runs
directly, without the ``autograd.Function`` machinery: same result, less
Python work per call.

=================  ===================================  ==============================
operator           forward                              backward
=================  ===================================  ==============================
copy_to            identity (enter the region)          all-reduce (sum partial grads)
reduce_from        all-reduce (sum partial outputs)     identity
scatter_to         split, keep this rank's chunk        all-gather the chunks' grads
gather_from        all-gather the chunks                split, keep this rank's chunk
sum_statistic      all-reduce (sum partial statistics)  all-reduce (sum partial grads)
gather_sum_grads   all-gather the chunks                reduce-scatter (sum, own chunk)
exchange           all-to-all (split one dim, join     the inverse all-to-all
                   another)
=================  ===================================  ==============================

``sum_statistic`` is the one operator whose output stays *inside* the region:
a statistic summed over the ranks' shards (a norm's sum of squares over every
head) that each rank then applies to its own shard only. ``gather_sum_grads``
and ``exchange`` serve context parallelism (:mod:`torchtp.cp`), where every
rank holds different tokens: a gathered tensor (keys and values of every
rank's tokens) is used differently on each rank, so its gradient is the sum of
every rank's use; an all-to-all moves tokens between a sequence split and a
head split, and its gradient moves back the same way.

Chunks follow the balanced split rule (:func:`torchtp.core.layouts.shard_sizes`):
a size that does not divide by the group size gives chunks that differ by
one, still with one collective each (padded to the largest chunk).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from . import grad_reduce as _grad_reduce
from . import health as _health
from . import ops as _comm
from . import tensor_memo as _tensor_memo
from .group_ref import GroupRef
from .runtime import ProcessGroup, group_rank, group_size
from .tensor_memo import TensorMemo


def rank_local_error(group: ProcessGroup | None, error: BaseException) -> BaseException:
    """Report ``error``, raised on this rank instead of its next collective, to the group.

    Use it for checks that can fail on some ranks only (an input's shape, token
    ids), as ``raise rank_local_error(group, err)``. If every rank raises at the
    same point the group stays usable; otherwise the ranks waiting in that
    collective raise :class:`~torchtp.InconsistentGroupError` naming this rank,
    and every later collective of the group raises it (see :mod:`torchtp.comm.health`).
    """
    return _health.fail(group, error)


class _CopyToRegion(torch.autograd.Function):
    """forward: identity; backward: all-reduce (sum) of the input gradient.

    Used where a replicated tensor enters sharded compute (the input of a
    weight-row-split linear): each rank's gradient is a partial sum over its
    output shard, and the sum over ranks is the full gradient.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = GroupRef(group)
        return x.view_as(x)

    @staticmethod
    @once_differentiable  # its collectives are not differentiable: no double backward
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _comm.all_reduce(grad, ctx.group()), None


class _CopyPairToRegion(torch.autograd.Function):
    """forward: identity on two tensors; backward: both gradients all-reduced, in order.

    One autograd node for two tensors entering one region (an experts
    module's token states and routing weights): every rank runs both
    all-reduces at the same point of its backward, also when its share of the
    compute left one of them unused (its missing gradient is a zero one).
    """

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, group: ProcessGroup
                ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.group = GroupRef(group)
        return a.view_as(a), b.view_as(b)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_a: torch.Tensor, grad_b: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, None]:
        return _comm.all_reduce(grad_a, ctx.group()), _comm.all_reduce(grad_b, ctx.group()), None


class _ReduceFromRegion(torch.autograd.Function):
    """forward: all-reduce (sum) of partial outputs; backward: identity.

    Used where partial sums leave sharded compute (the output of a
    weight-column-split linear). The summed output is replicated, so each rank
    already holds its full gradient and passes it through unchanged.
    ``inplace=True`` reduces the caller's own temporary without a copy.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, inplace: bool) -> torch.Tensor:
        if inplace and x.is_contiguous():
            ctx.mark_dirty(x)
            return _comm.all_reduce_(x, group)
        return _comm.all_reduce(x, group)

    @staticmethod
    @once_differentiable  # its collectives are not differentiable: no double backward
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class _ScatterToRegion(torch.autograd.Function):
    """forward: keep this rank's chunk along ``dim``; backward: all-gather along ``dim``.

    Used where a replicated tensor is cut into shards (a full input entering a
    weight-column-split linear). Each rank's chunk gradient is complete for
    that chunk, so gathering them gives the full gradient.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.size = GroupRef(group), dim, x.shape[dim]
        return _comm.split(x, dim, group_rank(group), group_size(group))

    @staticmethod
    @once_differentiable  # its collectives are not differentiable: no double backward
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _comm.all_gather(grad, ctx.dim, ctx.group(), ctx.size), None, None


class _GatherFromRegion(torch.autograd.Function):
    """forward: all-gather shards along ``dim``; backward: keep this rank's chunk.

    Used where sharded outputs become replicated (``gather_output=True``). The
    gathered tensor is replicated, so each rank holds the full gradient and
    its shard's gradient is the matching chunk.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, dim: int,
                size: int | None) -> torch.Tensor:
        ctx.group, ctx.dim = GroupRef(group), dim
        return _comm.all_gather(x, dim, group, size)

    @staticmethod
    @once_differentiable  # its collectives are not differentiable: no double backward
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        g = ctx.group()
        return _comm.split(grad, ctx.dim, group_rank(g), group_size(g)), None, None, None


class _ReduceScatterRegion(torch.autograd.Function):
    """forward: sum partials and keep this rank's chunk; backward: all-gather.

    The sequence-parallel pair of :class:`_GatherFromRegion`: the output chunk
    is sharded, and the gradient of every rank's partial input is the full
    gradient of the sum, i.e. the gathered chunk gradients.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.size = GroupRef(group), dim, x.shape[dim]
        return _comm.reduce_scatter(x, dim, group)

    @staticmethod
    @once_differentiable  # its collectives are not differentiable: no double backward
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _comm.all_gather(grad, ctx.dim, ctx.group(), ctx.size), None, None


class _SumStatistic(torch.autograd.Function):
    """forward: all-reduce (sum) of partial statistics; backward: all-reduce (sum).

    Each rank sums a statistic over its shard; the total is used by every rank
    on its own shard only, so each rank's gradient of the total is partial and
    the full gradient of every rank's part is their sum.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = GroupRef(group)
        return _comm.all_reduce(x, group)

    @staticmethod
    @once_differentiable  # its collectives are not differentiable: no double backward
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _comm.all_reduce(grad, ctx.group()), None


class _GatherSumGrads(torch.autograd.Function):
    """forward: all-gather chunks along ``dim``; backward: reduce-scatter along ``dim``.

    Every rank uses the gathered tensor for its own (different) work, so the
    gradient of rank ``r``'s chunk is the sum of every rank's gradient for it.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = GroupRef(group), dim
        return _comm.all_gather(x, dim, group)

    @staticmethod
    @once_differentiable  # its collectives are not differentiable: no double backward
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _comm.reduce_scatter(grad, ctx.dim, ctx.group()), None, None


def _all_to_all(x: torch.Tensor, group: ProcessGroup | None, split: int,
                join: int) -> torch.Tensor:
    # (..., S, ...) -> (world, ..., S/world, ...): chunk j goes to rank j; the
    # chunks received come back in rank order and are joined along ``join``.
    world = group_size(group)
    rows = torch.stack(x.chunk(world, dim=split))
    got = _comm.all_to_all(rows, [1] * world, [1] * world, group)
    return torch.cat(got.unbind(0), dim=join)


class _Exchange(torch.autograd.Function):
    """forward: all-to-all, split ``split``, join ``join``; backward: the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, split: int, join: int) -> torch.Tensor:
        ctx.group, ctx.split, ctx.join = GroupRef(group), split, join
        return _all_to_all(x, group, split, join)

    @staticmethod
    @once_differentiable  # its collectives are not differentiable: no double backward
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_to_all(grad, ctx.group(), ctx.join, ctx.split), None, None, None


def _needs_grad(x: torch.Tensor) -> bool:
    return x.requires_grad and torch.is_grad_enabled()


# Per group, the last tensor that entered the region with autograd, and its output.
# The output is a view of the input and keeps it alive, so the entry lives until
# the next call on the group replaces it or forget_shared_inputs() drops it.
_LAST_COPY: TensorMemo[torch.Tensor] = TensorMemo(last_per_group=True)


def copy_to_tensor_parallel_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Enter the TP region. forward: identity; backward: all-reduce the gradient.

    Consecutive calls with the same unmodified tensor (sibling layers fed one
    input: q/k/v, gate/up projections) return the same output, so autograd
    first sums their partial input gradients and backward all-reduces once,
    not once per layer (what Megatron gets by fusing QKV into one weight). The
    all-reduce is a sum, so the result is the same sum in another order.
    """
    if not _needs_grad(x) or group_size(group) == 1:
        return x
    if torch.compiler.is_compiling():  # the compiled graph holds no Python cache
        return _CopyToRegion.apply(x, group)
    out = _LAST_COPY.get(group, x)
    if out is None:
        out = _CopyToRegion.apply(x, group)
        # out is a view of x: an in-place change to either bumps the version checked.
        _LAST_COPY.put(group, x, out)
    return out


def copy_pair_to_tensor_parallel_region(a: torch.Tensor, b: torch.Tensor,
                                        group: ProcessGroup | None
                                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Enter the TP region with two tensors. forward: identity; backward: all-reduce both.

    Unlike two :func:`copy_to_tensor_parallel_region` calls, one autograd node
    issues both all-reduces, so ranks whose compute used only one of the
    tensors (or neither, as long as the node is in their graph) still issue
    the same collectives in the same order.
    """
    if not (_needs_grad(a) or _needs_grad(b)) or group_size(group) == 1:
        return a, b
    return _CopyPairToRegion.apply(a, b, group)


def reduces_in_backward(group: ProcessGroup | None) -> bool:
    """Whether a tensor that needs a gradient entered ``group``'s region since the last
    :func:`forget_shared_inputs` (the forward running now): a backward through it
    all-reduces its gradient over ``group``."""
    return _LAST_COPY.holds(group) or _grad_reduce.entered(group)


def forget_shared_inputs() -> None:
    """Drop the region entries of :func:`copy_to_tensor_parallel_region`.

    An entry's output is a view of its input, so it keeps the input (and,
    with gradients enabled, that forward's autograd graph) alive until the
    next call replaces it. ``DistributedModelWrapper`` calls this at the end
    of every forward of the model it wraps (a hook, so direct calls too),
    so nothing of one forward outlives it here. The entries of the overlapped
    path (:mod:`torchtp.comm.grad_reduce`) go too.
    """
    _LAST_COPY.clear()
    _grad_reduce.forget()
    _tensor_memo.KEPT = False


def reduce_from_tensor_parallel_region(
    x: torch.Tensor, group: ProcessGroup | None, inplace: bool = False
) -> torch.Tensor:
    """Leave the TP region by summing. forward: all-reduce; backward: identity.

    Args:
        x: This rank's partial sum.
        group: The TP group.
        inplace: Reduce ``x`` itself (only for a temporary the caller created).
    """
    if group_size(group) == 1:
        return x
    if not _needs_grad(x):
        return _comm.all_reduce_(x, group) if inplace and x.is_contiguous() \
            else _comm.all_reduce(x, group)
    return _ReduceFromRegion.apply(x, group, inplace)


def scatter_to_tensor_parallel_region(
    x: torch.Tensor, group: ProcessGroup | None, dim: int = -1
) -> torch.Tensor:
    """Cut a replicated tensor. forward: keep own chunk of ``dim``; backward: all-gather."""
    if group_size(group) == 1:
        return x
    if not _needs_grad(x):
        return _comm.split(x, dim, group_rank(group), group_size(group))
    return _ScatterToRegion.apply(x, group, dim)


def gather_from_tensor_parallel_region(
    x: torch.Tensor, group: ProcessGroup | None, dim: int = -1, size: int | None = None
) -> torch.Tensor:
    """Join shards. forward: all-gather along ``dim``; backward: keep own chunk.

    Args:
        x: This rank's shard.
        group: The TP group.
        dim: Dimension to join along.
        size: Full size along ``dim`` when shards may differ by one (balanced
            split rule); ``None`` for equal shards.
    """
    if group_size(group) == 1:
        return x
    if not _needs_grad(x):
        return _comm.all_gather(x, dim, group, size)
    return _GatherFromRegion.apply(x, group, dim, size)


def reduce_scatter_to_tensor_parallel_region(
    x: torch.Tensor, group: ProcessGroup | None, dim: int = -1
) -> torch.Tensor:
    """Sum partials into shards. forward: reduce-scatter along ``dim``; backward: all-gather."""
    if group_size(group) == 1:
        return x
    if not _needs_grad(x):
        return _comm.reduce_scatter(x, dim, group)
    return _ReduceScatterRegion.apply(x, group, dim)


def sum_statistic_over_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum a per-shard statistic over the ranks. forward: all-reduce; backward: all-reduce.

    For a statistic of the whole tensor that each rank applies to its own shard
    (the mean of squares of a norm over every head, each rank holding some heads).

    Args:
        x: This rank's partial statistic, e.g. ``(B, T, 1)`` sums of squares.
        group: The TP group.
    """
    if group_size(group) == 1:
        return x
    if not _needs_grad(x):
        return _comm.all_reduce(x, group)
    return _SumStatistic.apply(x, group)


def gather_sum_grads(x: torch.Tensor, group: ProcessGroup | None, dim: int) -> torch.Tensor:
    """Gather every rank's chunk for different use on each rank.

    forward: all-gather along ``dim`` (equal chunks); backward: reduce-scatter
    along ``dim``. For keys and values of every rank's tokens, each rank
    attending with its own queries (context parallelism).
    """
    if group_size(group) == 1:
        return x
    if not _needs_grad(x):
        return _comm.all_gather(x, dim, group)
    return _GatherSumGrads.apply(x, group, dim)


def exchange(x: torch.Tensor, group: ProcessGroup | None, split: int, join: int) -> torch.Tensor:
    """Move chunks between ranks. forward: all-to-all; backward: the inverse all-to-all.

    Cuts ``x`` into ``group size`` equal chunks along ``split``, sends chunk
    ``j`` to rank ``j`` and joins the chunks received along ``join``, in rank
    order: ``(B, H, T/cp, D)`` with ``split=1, join=2`` becomes
    ``(B, H/cp, T, D)`` (Ulysses: a sequence split becomes a head split).
    ``x.shape[split]`` must divide by the group size (the caller checks).
    """
    if group_size(group) == 1:
        return x
    if not _needs_grad(x):
        return _all_to_all(x, group, split, join)
    return _Exchange.apply(x, group, split, join)
