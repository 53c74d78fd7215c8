"""ColumnParallelLinear: splits the weight's columns (in_features) across ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import ops as _comm
from ..comm import overlap as _overlap
from ..comm.group_ref import slot
from ..comm.regions import (
    rank_local_error,
    reduce_from_tensor_parallel_region,
    scatter_to_tensor_parallel_region,
)
from ..comm.runtime import ProcessGroup
from ..comm.sequence_parallel import reduce_scatter_to_sequence_shards
from ..core.layouts import ParamLayout
from ._base import require_group
from ._shape import input_mismatch
from .linear_reduce_scatter import linear_reduce_scatter
from .parallel_linear import ParallelLinear
from .rng import TRACKER, split_region_ends

_GROUP = slot("group")  # where ParallelLinear's WeakGroup keeps its weak reference


class ColumnParallelLinear(ParallelLinear):
    """A Linear whose weight *columns* (``in_features``) are split across ranks.

    The weight has PyTorch's layout ``(out_features, in_features)``; rank ``r``
    holds its balanced share of the columns (``r*in/tp : (r+1)*in/tp`` when tp
    divides in; otherwise the first ``in % tp`` ranks hold one column more, see
    :func:`torchtp.core.layouts.shard_sizes`) and multiplies them with its slice
    of the input features, giving a partial sum of the full output. One
    all-reduce sums the partials, then the (replicated) bias is added exactly
    once. Megatron calls this ``RowParallelLinear`` and PyTorch/HF call it
    ``rowwise``.

    forward: ``(..., in_features_local)`` -> all-reduce -> ``(..., out_features)``
    on every rank; with ``input_is_parallel=False`` the input is the full
    ``(..., in_features)`` and each rank keeps its own slice first.
    backward: the input gradient needs no communication (all-gathered only when
    the input was full); the bias gradient equals ``nn.Linear``'s.

    Args:
        in_features: Total input features (at least ``world_size``; need not divide).
        out_features: Output features (not split).
        bias: Add a (replicated) bias after the reduction.
        world_size: Ranks to split over; ``None`` uses the process group's size.
        rank: This rank; ``None`` uses the process group's rank.
        dtype: Parameter dtype.
        device: Parameter device; ``"meta"`` skips initialisation.
        input_is_parallel: The input is already this rank's slice of features.
        group: Process group; ``None`` for the default TP group.

    Attributes:
        sequence_dim: Set by sequence parallelism: reduce-scatter the partial
            output along this (sequence) dimension instead of all-reducing it,
            so each rank gets its sequence shard; the bias is then added to the
            shard and its gradient is summed over the TP group.
        partial_output: Set by the ``"rowwise_partial"`` style: return this
            rank's partial sum without reducing it, because a later all-reduce
            (a ``"reduce_output"``/``"reduce_input"`` module) sums several such
            layers at once (a hand-written MoE's experts). The (replicated)
            bias is added on rank 0 only, so the later sum adds it once; its
            gradient is the full one on every rank.
        overlap: Overlap this layer's communication with its computation
            (:mod:`torchtp.comm.overlap`): ``True``/``False`` forces it,
            ``None`` (default) follows ``TP_OVERLAP``, else the measured
            default for the device. Only under sequence parallelism: the
            product and its reduce-scatter run piece by piece along the
            sequence, each piece's collective beside the next piece's product
            (:mod:`torchtp.layers.linear_reduce_scatter`).
            ``DistributedModelWrapper(overlap=...)`` sets it on every layer.

    Raises:
        ValueError: ``in_features`` is smaller than ``world_size`` (the
            message lists the valid sizes), or ``world_size``/``rank`` contradict
            the process group.
    """

    sequence_dim: int | None = None
    partial_output: bool = False
    split_dim = 1

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True,
        world_size: int | None = None, rank: int | None = None,
        dtype: torch.dtype | None = None, device: torch.device | str | None = None,
        input_is_parallel: bool = True, group: ProcessGroup | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, world_size, rank, dtype, device, group)
        self._set_input(input_is_parallel)

    @property
    def in_features_local(self) -> int:
        """Columns (input features) this rank holds."""
        return self.local_features

    def _set_input(self, input_is_parallel: bool) -> None:
        if not input_is_parallel and not self.is_balanced_share:
            raise ValueError(f"{self._name()}: input_is_parallel=False needs this rank's "
                             f"columns to be its balanced share of in_features (rank {self.rank} "
                             f"of world_size={self.world_size}); these columns are "
                             f"{self.tp_layouts['weight'].segments}")
        self.input_is_parallel = input_is_parallel

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, world_size: int | None = None, rank: int | None = None,
        input_is_parallel: bool = True, group: ProcessGroup | None = None,
    ) -> ColumnParallelLinear:
        """Build this rank's shard of an existing ``nn.Linear`` (copies only the slice).

        The full layer is not referenced afterwards, so it can be freed. Meta
        tensors stay on meta.

        Raises:
            ValueError: ``in_features`` is smaller than the world size.
        """
        layer = cls._cut(linear, world_size, rank, group)
        layer._set_input(input_is_parallel)
        return layer

    @classmethod
    def from_shards(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, in_features: int,
        out_features: int, world_size: int | None = None, rank: int | None = None,
        input_is_parallel: bool = True, group: ProcessGroup | None = None,
        requires_grad: bool = True, layouts: dict[str, ParamLayout] | None = None,
    ) -> ColumnParallelLinear:
        """Wrap already-cut local tensors: ``weight`` ``(out_features, cols)``, full ``bias``.

        ``layouts`` say which columns of the full layer these are (e.g. the
        columns of this rank's attention heads); the default is this rank's
        balanced share.
        """
        layer = cls._wrap(weight, bias, in_features, out_features, world_size, rank, group,
                          requires_grad, layouts)
        layer._set_input(input_is_parallel)
        return layer

    @property
    def expected_input_features(self) -> int:
        """Last-dimension size the forward expects on this rank."""
        return self.in_features_local if self.input_is_parallel else self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., in/tp)`` (or ``(..., in)``) -> ``(..., out)``, summed over ranks."""
        if self.world_size == 1:
            # No check on the hot path: F.linear validates, we only reword its error.
            try:
                return F.linear(x, self.weight, self.bias)
            except RuntimeError as err:
                mismatch = input_mismatch(self, x, self.in_features)
                if mismatch is None:
                    raise
                raise mismatch from err
        ref, weight = self.__dict__[_GROUP], self.weight  # the weak group: read without a call
        group = ref() if ref is not None else None
        if group is None and ref is not None:
            group = self.group  # destroyed: raises GroupDestroyedError, naming this layer
        # (out, in/tp): its columns are this rank's share of the input features
        expected = weight.shape[1] if self.input_is_parallel else self.in_features
        if not x.dim() or x.shape[-1] != expected:
            mismatch = input_mismatch(self, x, expected)
            # Other ranks may be fine and already waiting in the collective: tell them.
            raise rank_local_error(group, mismatch)  # type: ignore[arg-type]
        if group is None:
            group = require_group(self._name, group, self.world_size)
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, group, -1)  # (..., in/tp)
        elif self.training and (TRACKER.depth or self.streamed):  # the split region ends
            # (in a wrapped training forward or its recomputation; see layers/rng.py)
            self.__dict__["streamed"] = split_region_ends(self)
        if self.sequence_dim is not None and not self.partial_output \
                and not torch.compiler.is_compiling() \
                and _overlap.enabled("sequence", self.overlap, x.device):
            # (B, S, out): this rank's sequence shard, each piece's reduce-scatter
            # beside the next piece's product.
            y = linear_reduce_scatter(x, weight, group, self.sequence_dim, _overlap.chunks())
            return y if self.bias is None else y.add_(self.bias)
        return self.sum_partial(F.linear(x, weight), group)

    def sum_partial(self, partial: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        """This rank's partial sum ``(..., out)`` -> the layer's output, bias added once.

        Summed over the group (all-reduce, or reduce-scatter onto sequence shards);
        with ``partial_output`` left as the partial sum for a later reduction.
        ``partial`` must be the caller's own temporary (the all-reduce writes into it).
        A LoRA adapter's terms join ``partial`` first: they are partial sums too.
        """
        if self.partial_output:  # summed later, with other layers' partials
            return partial if self.bias is None else _BiasOnce.apply(
                partial, self.bias, self.rank == 0)
        if self.sequence_dim is not None:  # (B, S, out): this rank's sequence shard
            y = reduce_scatter_to_sequence_shards(partial, group, self.sequence_dim)
        elif (partial.requires_grad and torch.is_grad_enabled()) or not partial.is_contiguous():
            y = reduce_from_tensor_parallel_region(partial, group, inplace=True)
        else:  # no autograd node needed: the plain in-place sum of our own temporary
            y = _comm.all_reduce_(partial, group)
        bias = self.bias
        if bias is not None:
            # Once, after the sum, so its gradient equals nn.Linear's. In place: y is
            # our own all-reduced temporary and the matmul's backward does not need it.
            y = y.add_(bias)
        return y

    def extra_repr(self) -> str:
        partial = ", partial_output=True" if self.partial_output else ""
        return f"{self._split_repr()}, input_is_parallel={self.input_is_parallel}{partial}"


class _BiasOnce(torch.autograd.Function):
    """Add the bias to a partial sum on one rank only; its gradient on every rank.

    forward: ``partial + bias`` on the first rank, ``partial`` elsewhere, so the
    sum over ranks adds it once. backward: the output's gradient is the same on
    every rank (the later all-reduce's backward is the identity), so each rank
    sums it into the full bias gradient, as ``nn.Linear`` would; no collective.
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, partial: torch.Tensor,
                bias: torch.Tensor, first: bool) -> torch.Tensor:
        return partial + bias if first else partial.clone()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, grad.reshape(-1, grad.shape[-1]).sum(0), None
