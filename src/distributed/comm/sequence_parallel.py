"""Sequence-parallel regions: tensors split along the sequence dimension.

With sequence parallelism, the parts of a transformer layer that work token
by token (norms, dropout, residual adds) run on a *sequence shard*: rank ``r``
holds tokens ``r*S .. (r+1)*S`` of the sequence, ``S = ceil(T / tp)``. A
sequence that does not divide by ``tp`` is padded at its end with zero rows
up to ``S * tp`` (so the last ranks may hold padding); every collective then
moves equal shards, exactly as for a divisible length. The padding rows never
reach a real token: attention and the model's output drop them (their
gradients are zero), so results and gradients are exact.

=================================  ==================================  ==============================
operator                           forward                             backward
=================================  ==================================  ==============================
scatter_to_sequence_shards         pad, keep own shard                 all-gather shards, drop padding
gather_from_sequence_shards        all-gather, drop padding            pad, keep own shard
gather_for_tensor_parallel         all-gather (drop padding)           pad, reduce-scatter (sum partials)
reduce_scatter_to_sequence_shards  pad, reduce-scatter (sum partials)  all-gather, drop padding
own_shard_grad                     identity                            keep own shard's rows, zeros
                                                                       elsewhere (no collective)
=================================  ==================================  ==============================

``gather_for_tensor_parallel`` enters a TP region (the input of the
weight-rows-split projections): inside it every rank computes with its own
heads or features, so each rank's input gradient is a *partial* sum, and the
backward reduce-scatter both sums it and returns each rank its shard (the
all-reduce of :func:`~torchtp.comm.regions.copy_to_tensor_parallel_region` is not
needed). ``reduce_scatter_to_sequence_shards`` leaves it (the output of the
weight-columns-split projection) instead of an all-reduce. ``own_shard_grad`` lets
a replicated consumer read that gathered tensor (a LoRA adapter's ``A`` beside a
weight-rows-split projection): its input gradient is complete on every rank, so
each rank passes on only its own shard's rows and the reduce-scatter counts it once.

The full-sequence tensor that ``gather_for_tensor_parallel`` returns is not
kept for the backward: the projections it feeds save this rank's shard
instead and all-gather it again when their weight gradients need it (see
:mod:`torchtp.layers.sequence_linear`), once per group of sibling projections, as
Megatron does. :func:`gathered_source` tells a projection whether its input
is such a tensor.

With overlap (:mod:`torchtp.comm.overlap`): under ``"grad_reduce"`` the
projections fed one gathered tensor share a
:class:`~torchtp.comm.grad_reduce.SharedGrad` whose reduction is the
reduce-scatter of the summed input gradient, started by the last of them
beside its weight gradient (the gather's backward then passes the result on),
and :meth:`Regather.start` issues the re-gather before the input gradient is
computed. Under ``"sequence"`` :func:`gather_for_tensor_parallel` gathers in
pieces and computes the projections' products beside them
(:func:`torchtp.comm.chunked.all_gather_apply`); each projection takes its
product with :func:`take_precomputed`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..core import torch_compat as _torch_compat
from ..core.layouts import shard_range
from ..core.torch_compat import is_view
from . import ops as _comm
from .chunked import Product, all_gather_apply
from .grad_reduce import Finish, SharedGrad
from .group_ref import GroupRef, WeakGroup
from .runtime import ProcessGroup, group_rank, group_size
from .tensor_memo import TensorMemo


def shard_length(length: int, world_size: int) -> int:
    """Tokens per sequence shard: ``ceil(length / world_size)`` (the split rule's ``"ceil"``)."""
    return shard_range(length, world_size, 0, rule="ceil")[1]


def pad_sequence(x: torch.Tensor, dim: int, world_size: int) -> torch.Tensor:
    """``x`` with zero rows appended along ``dim`` up to a multiple of ``world_size``."""
    extra = shard_length(x.shape[dim], world_size) * world_size - x.shape[dim]
    if not extra:
        return x
    dim = dim % x.dim()
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, extra]  # F.pad lists the last dim first
    return F.pad(x, pad)


def _owned(t: torch.Tensor) -> torch.Tensor:
    # A view (of a temporary) returned by an autograd.Function cannot be modified in
    # place later (e.g. a bias added in place); copy in the rare case one is a view.
    return t.clone() if is_view(t) else t


def _shard(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    size = group_size(group)
    return _owned(_comm.split(pad_sequence(x, dim, size), dim, group_rank(group), size))


def _gather(x: torch.Tensor, dim: int, group: ProcessGroup, length: int | None) -> torch.Tensor:
    full = _comm.all_gather(x, dim, group)  # (..., S * tp, ...)
    if length is not None and length != full.shape[dim]:
        full = full.narrow(dim, 0, length).contiguous()
    return _owned(full)


def _reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    return _owned(_comm.reduce_scatter(pad_sequence(x, dim, group_size(group)), dim, group))


def _gather_start(x: torch.Tensor, dim: int, group: ProcessGroup,
                  length: int | None) -> Finish:
    """:func:`_gather` without waiting: the returned callable waits and gives its result."""
    dim = dim % x.dim()
    pending = _comm.all_gather_start(x, group)  # (tp * B, S, d): the shards along dim 0

    def finish() -> torch.Tensor:
        out = pending.wait()
        full = torch.cat(out.chunk(group_size(group), dim=0), dim=dim) if dim else out
        if length is not None and length != full.shape[dim]:
            full = full.narrow(dim, 0, length).contiguous()
        return _owned(full)
    return finish


def _reduce_scatter_start(dim: int, ref: GroupRef) -> Callable[[torch.Tensor], Finish]:
    """:func:`_reduce_scatter` without waiting (the start of a :class:`SharedGrad`)."""
    def start(x: torch.Tensor) -> Finish:
        group = ref()
        d = dim % x.dim()
        padded = pad_sequence(x, d, group_size(group))
        full = (padded.movedim(d, 0) if d else padded).contiguous()  # (S * tp, ...)
        pending = _comm.reduce_scatter_start(full, group)

        def finish() -> torch.Tensor:
            out = pending.wait()  # (S, ...)
            return _owned(out.movedim(0, d).contiguous() if d else out)
        return finish
    return start


def shared_sequence_grads(group: ProcessGroup, dim: int) -> SharedGrad:
    """A :class:`SharedGrad` whose reduction is the reduce-scatter of a gathered input's
    gradient: the projections fed one gathered block input overlap it with their weight
    gradients (see :mod:`torchtp.comm.grad_reduce`)."""
    ref = GroupRef(group)  # the graph of a kept output must not keep the group alive
    return SharedGrad(_reduce_scatter_start(dim, ref),
                      lambda t: _reduce_scatter(t, dim, ref()))


@dataclass(eq=False)
class GatherPlan:
    """The chunked gather of a block input and the projections computed with it.

    Attributes:
        products: The projections expected to read the gathered tensor.
        chunks: Pieces per sequence shard.
        outputs: Their results, once gathered.
    """

    products: list[Product]
    chunks: int
    outputs: list[torch.Tensor] = field(default_factory=list)


class _ScatterToShards(torch.autograd.Function):
    """forward: pad, keep own sequence shard; backward: all-gather, drop padding.

    The input is replicated, so each rank's shard gradient is complete for
    its tokens and gathering them gives the full gradient.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.length = GroupRef(group), dim, x.shape[dim]
        return _shard(x, dim, group)

    @staticmethod
    @once_differentiable  # its collectives are not differentiable: no double backward
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.dim, ctx.group(), ctx.length), None, None


class _GatherFromShards(torch.autograd.Function):
    """forward: all-gather sequence shards, drop padding; backward: pad, then
    keep own shard (``partial=False``) or reduce-scatter (``partial=True``).

    ``partial=False``: the gathered tensor is used identically on every rank
    (replicated), so each rank holds its full gradient and its shard's
    gradient is a slice. ``partial=True``: it feeds weight-rows-split
    projections, each rank's gradient is a partial sum over its heads/features,
    and the reduce-scatter sums the partials and hands each rank its shard.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, dim: int, length: int | None,
                partial: bool, shared: SharedGrad | None = None,
                plan: GatherPlan | None = None) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.partial, ctx.shared = GroupRef(group), dim, partial, shared
        if shared is not None:  # projections overlapping the reduce-scatter pass no gradient
            ctx.set_materialize_grads(False)
        if plan is None:
            return _gather(x, dim, group, length)
        full, plan.outputs = all_gather_apply(x, dim, group, length, plan.products, plan.chunks)
        return _owned(full)

    @staticmethod
    @once_differentiable  # its collectives are not differentiable: no double backward
    def backward(ctx, grad: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, None, None, None, None, None, None]:
        if ctx.shared is not None:  # the projections' reduced sum (partial=True)
            return ctx.shared.settle(grad), None, None, None, None, None, None
        assert grad is not None  # materialized without a SharedGrad
        back = _reduce_scatter if ctx.partial else _shard
        return back(grad, ctx.dim, ctx.group()), None, None, None, None, None, None


class _ReduceScatterToShards(torch.autograd.Function):
    """forward: pad, reduce-scatter partial sums; backward: all-gather, drop padding.

    Leaves a weight-columns-split projection: the output shard is the sum of
    every rank's partial output, so every partial input's gradient is the
    full (gathered) gradient.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.length = GroupRef(group), dim, x.shape[dim]
        return _reduce_scatter(x, dim, group)

    @staticmethod
    @once_differentiable  # its collectives are not differentiable: no double backward
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.dim, ctx.group(), ctx.length), None, None


def _needs_grad(x: torch.Tensor) -> bool:
    return x.requires_grad and torch.is_grad_enabled()


def scatter_to_sequence_shards(x: torch.Tensor, group: ProcessGroup | None,
                               dim: int = 1) -> torch.Tensor:
    """Replicated ``(B, T, d)`` -> own shard ``(B, S, d)``. backward: all-gather."""
    if group is None or group_size(group) == 1:
        return x
    if not _needs_grad(x):
        return _shard(x, dim, group)
    return _ScatterToShards.apply(x, group, dim)


def gather_from_sequence_shards(x: torch.Tensor, group: ProcessGroup | None, dim: int,
                                length: int) -> torch.Tensor:
    """Shard ``(B, S, d)`` -> replicated ``(B, length, d)``. backward: keep own shard."""
    if group is None or group_size(group) == 1:
        return x
    if not _needs_grad(x):
        return _gather(x, dim, group, length)
    return _GatherFromShards.apply(x, group, dim, length, False)


def gather_for_tensor_parallel(x: torch.Tensor, group: ProcessGroup | None, dim: int,
                               length: int | None,
                               linears: Sequence[tuple[torch.Tensor, torch.Tensor | None]] = (),
                               chunks: int = 0) -> torch.Tensor:
    """Shard ``(B, S, d)`` -> ``(B, length or S*tp, d)`` for TP compute. backward: reduce-scatter.

    With gradients, the result is remembered (weakly, until it dies) so that
    the projections fed it can save ``x`` instead of it: see :func:`gathered_source`.

    Args:
        x: This rank's sequence shard.
        group: The TP group.
        dim: The sequence dimension.
        length: Tokens kept (the padding dropped); ``None`` keeps ``S * tp``.
        linears: ``(weight, bias)`` of the weight-rows-split projections that
            will read the result (q/k/v, gate/up). With ``chunks``, their
            products are computed piece by piece beside the gather
            (:func:`torchtp.comm.chunked.all_gather_apply`) and handed to them
            (:func:`take_precomputed`).
        chunks: Pieces per shard for the chunked gather; 0 gathers at once.
    """
    if group is None or group_size(group) == 1:
        return x
    compiling = torch.compiler.is_compiling()
    plan = GatherPlan([Product(w, b) for w, b in linears], chunks) \
        if chunks and not compiling else None
    if not _needs_grad(x):
        if plan is None:
            return _gather(x, dim, group, length)
        full, plan.outputs = all_gather_apply(x, dim, group, length, plan.products, chunks)
        _remember_products(full, linears, plan.outputs)
        return _owned(full)
    if compiling:  # the compiled graph holds no Python registry
        return _GatherFromShards.apply(x, group, dim, length, True)
    shared = shared_sequence_grads(group, dim)
    full = _GatherFromShards.apply(x, group, dim, length, True, shared, plan)
    _GATHERED.put(group, full, GatheredInput(x, _torch_compat.version_counter(x),
                                             Regather(dim, length, group), shared))
    if plan is not None:
        _remember_products(full, linears, plan.outputs)
    return full


@dataclass(eq=False)
class _Product:
    """A projection's output computed with the gather, and what it was computed from."""

    weight: torch.Tensor
    versions: tuple[int, int | None]
    bias: torch.Tensor | None
    autocast: tuple[bool, torch.dtype | None]
    out: torch.Tensor


def _autocast_state(device: torch.device) -> tuple[bool, torch.dtype | None]:
    on = torch.is_autocast_enabled(device.type)
    return on, torch.get_autocast_dtype(device.type) if on else None


def _versions(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, int | None]:
    return (_torch_compat.version_counter(weight),
            None if bias is None else _torch_compat.version_counter(bias))


def _remember_products(full: torch.Tensor, linears: Sequence[tuple[torch.Tensor,
                       torch.Tensor | None]], outs: list[torch.Tensor]) -> None:
    state = _autocast_state(full.device)
    _PRODUCTS.put(None, full, [_Product(w, _versions(w, b), b, state, out)
                               for (w, b), out in zip(linears, outs, strict=True)])


def take_precomputed(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` if the chunked gather that made ``x`` computed it.

    Only for the unmodified gathered ``x``, the same unmodified ``weight`` and
    ``bias``, and the same autocast state; each result is handed out once.
    The result carries no autograd history: a caller that needs gradients
    wraps it (:mod:`torchtp.layers.sequence_linear`).
    """
    if torch.compiler.is_compiling():
        return None
    products = _PRODUCTS.get(None, x)
    if not products:
        return None
    for i, p in enumerate(products):
        if p.weight is weight and p.bias is bias:
            del products[i]
            if p.versions == _versions(weight, bias) \
                    and p.autocast == _autocast_state(x.device):
                return p.out
            return None
    return None


@dataclass(eq=False)
class Regather:
    """Rebuilds one gathered full-sequence tensor from its shard, in the backward.

    Shared by the sibling projections fed that tensor (q/k/v, gate/up): the
    first one whose weight gradient needs it all-gathers the shard, the
    others reuse the result, and the last one lets it go, so the backward
    costs one all-gather per block and holds one full tensor at a time. The
    end of the backward lets it go in any case (a sibling whose backward did
    not run: ``autograd.grad`` of some weights, an unused output).

    Attributes:
        group: The TP group.
        dim: Sequence dimension.
        length: Tokens kept after the gather (``None``: keep the padding).
        users: Projections that will call :meth:`full` in the backward.
    """

    dim: int
    length: int | None
    group: WeakGroup[ProcessGroup] = WeakGroup(required=True)  # held weakly (group_ref)
    users: int = 0
    _full: torch.Tensor | None = None
    _pending: int = 0
    _started: Finish | None = None

    def start(self, shard: torch.Tensor) -> None:
        """Start gathering ``shard`` without waiting, unless it is gathered or under way.

        The backward computes the input gradient while it travels; :meth:`full`
        waits for it.
        """
        if self._started is None and (self._full is None or self._full.dtype != shard.dtype):
            self._started = _gather_start(shard, self.dim, self.group, self.length)
            _torch_compat.at_end_of_backward(self._drop)

    def full(self, shard: torch.Tensor) -> torch.Tensor:
        """The full-sequence tensor ``(B, length or S*tp, d)`` gathered from ``shard``."""
        if self._started is not None:
            started, self._started = self._started, None
            self._full, self._pending = started(), self.users
        if self._full is None or self._full.dtype != shard.dtype:
            self._full = _gather(shard, self.dim, self.group, self.length)
            self._pending = self.users
            _torch_compat.at_end_of_backward(self._drop)
        return self._full

    def release(self) -> None:
        """One user is done with :meth:`full`; the last one frees it."""
        self._pending -= 1
        if self._pending <= 0:
            self._drop()

    def _drop(self) -> None:
        if self._started is not None:  # never read: still wait, the backend holds the buffers
            started, self._started = self._started, None
            started()
        self._full, self._pending = None, 0


@dataclass(eq=False)
class GatheredInput:
    """What the projections fed one gathered tensor need for their backward.

    Lives as long as the gathered tensor (its :data:`_GATHERED` entry), so
    the casts it shares among the siblings are then held only by the
    backward graphs that saved them.

    Attributes:
        shard: The shard the tensor was gathered from.
        shard_version: The shard's version counter at the gather.
        regather: Shared by the siblings in the backward.
        shared: The siblings' input-gradient sum, reduce-scattered by the last
            one (when their overlap is on) or by the gather's backward.
    """

    shard: torch.Tensor
    shard_version: int
    regather: Regather
    shared: SharedGrad | None = None
    _casts: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def shard_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The shard in ``dtype`` (what autocast computes in): one copy for all siblings.

        Casting commutes with the gather, so re-gathering the cast shard gives
        exactly the cast input the forward multiplied, at the cast's size.
        """
        if dtype == self.shard.dtype:
            return self.shard.detach()
        cast = self._casts.get(dtype)
        if cast is None:
            cast = self._casts[dtype] = self.shard.detach().to(dtype)  # (B, S, d)
        return cast


# Every live tensor gather_for_tensor_parallel returned with autograd (held
# weakly), with what the projections fed it need.
_GATHERED: TensorMemo[GatheredInput] = TensorMemo(last_per_group=False)
# Every live tensor the chunked gather returned (held weakly), with the products
# computed beside it that no projection has taken yet.
_PRODUCTS: TensorMemo[list[_Product]] = TensorMemo(last_per_group=False)


def gathered_source(x: torch.Tensor) -> GatheredInput | None:
    """What :func:`gather_for_tensor_parallel` recorded for ``x``, if ``x`` is its
    unmodified output (with gradients) and the shard is unmodified too, else ``None``.

    Looked up by the tensor itself, so a recomputation under activation
    checkpointing (which keeps ``x`` alive) finds it as the forward did.
    """
    if torch.compiler.is_compiling():
        return None
    source = _GATHERED.get(None, x)
    if source is None or _torch_compat.version_counter(source.shard) != source.shard_version:
        return None  # a changed shard would re-gather to other values than x's
    return source


def reduce_scatter_to_sequence_shards(x: torch.Tensor, group: ProcessGroup | None,
                                      dim: int) -> torch.Tensor:
    """Partial ``(B, T, d)`` -> summed own shard ``(B, S, d)``. backward: all-gather."""
    if group is None or group_size(group) == 1:
        return x
    if not _needs_grad(x):
        return _reduce_scatter(x, dim, group)
    return _ReduceScatterToShards.apply(x, group, dim)


class _OwnShardGrad(torch.autograd.Function):
    """forward: identity; backward: this rank's sequence shard rows of the gradient
    (``S = ceil(n / tp)`` rows from ``rank * S``, clipped to the ``n`` rows), zeros elsewhere.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, rank: int, size: int, dim: int) -> torch.Tensor:
        ctx.rank, ctx.size, ctx.dim = rank, size, dim
        return x.view_as(x)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        rows = grad.shape[ctx.dim]  # T (padding dropped) or S * tp (kept)
        start, count = shard_range(rows, ctx.size, ctx.rank, rule="ceil")
        out = torch.zeros_like(grad)
        out.narrow(ctx.dim, start, count).copy_(grad.narrow(ctx.dim, start, count))
        return out, None, None, None


def own_shard_grad(x: torch.Tensor, group: ProcessGroup | None, dim: int) -> torch.Tensor:
    """A gathered ``(B, T, d)`` for a replicated consumer. backward: keep own shard's rows.

    ``x`` is :func:`gather_for_tensor_parallel`'s output, whose backward sums the
    ranks' gradients (partial sums from the weight-rows-split projections). A
    replicated consumer's gradient is complete on every rank: passing on only this
    rank's shard rows (zeros elsewhere) makes that sum count it once.
    """
    if group is None or group_size(group) == 1 or not _needs_grad(x):
        return x
    return _OwnShardGrad.apply(x, group_rank(group), group_size(group), dim)
