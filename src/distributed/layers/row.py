"""RowParallelLinear: splits the weight's rows (out_features) across ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import overlap as _overlap
from ..comm.group_ref import slot
from ..comm.regions import (
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    rank_local_error,
)
from ..comm.runtime import ProcessGroup
from ..core.errors import MissingProcessGroupError, launch_hint
from ..core.layouts import ParamLayout
from ._base import require_group
from ._shape import input_mismatch
from .linear_grad_reduce import linear_reducing_input_grad
from .parallel_linear import ParallelLinear
from .rng import TRACKER, split_region_begins
from .sequence_linear import linear_on_gathered

_GROUP = slot("group")  # where ParallelLinear's WeakGroup keeps its weak reference


class RowParallelLinear(ParallelLinear):
    """A Linear whose weight *rows* (``out_features``) are split across ranks.

    The weight has PyTorch's layout ``(out_features, in_features)``; rank ``r``
    holds its balanced share of the rows (``r*out/tp : (r+1)*out/tp`` when tp
    divides out; otherwise the first ``out % tp`` ranks hold one row more, see
    :func:`torchtp.core.layouts.shard_sizes`) and the matching bias entries. Every
    rank sees the full input and produces its slice of the output features, so
    the forward needs no communication. Megatron calls this
    ``ColumnParallelLinear`` and PyTorch/HF call it ``colwise``.

    forward: ``(..., in_features)`` -> ``(..., out_features_local)``, or the
    full ``(..., out_features)`` with ``gather_output=True`` (one all-gather).
    backward: the input gradient is all-reduced (each rank's is a partial sum
    over its output slice).

    Args:
        in_features: Input features (not split).
        out_features: Total output features (at least ``world_size``; need not divide).
        bias: Add a (split) bias.
        world_size: Ranks to split over; ``None`` uses the process group's size.
        rank: This rank; ``None`` uses the process group's rank.
        dtype: Parameter dtype.
        device: Parameter device; ``"meta"`` skips initialisation.
        gather_output: All-gather the output so every rank has all features.
        group: Process group; ``None`` for the default TP group.

    Attributes:
        sequence_dim: Set by sequence parallelism: the input was all-gathered
            from sequence shards along this dimension by
            :func:`~torchtp.comm.sequence_parallel.gather_for_tensor_parallel`, whose
            backward reduce-scatters the input gradient, so no all-reduce here;
            the weight gradient re-gathers the input from its shard instead
            of keeping it (:mod:`torchtp.layers.sequence_linear`).
        overlap: Overlap this layer's communication with its computation
            (:mod:`torchtp.comm.overlap`): ``True``/``False`` forces it,
            ``None`` (default) follows ``TP_OVERLAP``, else the measured
            default for the device. Without sequence parallelism the backward
            starts the input-gradient all-reduce, computes the weight
            gradient meanwhile, then waits
            (:mod:`torchtp.layers.linear_grad_reduce`); with it, the backward
            re-gathers the input shard while it computes the input gradient.
            ``DistributedModelWrapper(overlap=...)`` sets it on every layer.

    Raises:
        ValueError: ``out_features`` is smaller than ``world_size`` (the
            message lists the valid sizes), or ``world_size``/``rank`` contradict
            the process group.
    """

    sequence_dim: int | None = None
    split_dim = 0

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True,
        world_size: int | None = None, rank: int | None = None,
        dtype: torch.dtype | None = None, device: torch.device | str | None = None,
        gather_output: bool = False, group: ProcessGroup | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, world_size, rank, dtype, device, group)
        self._set_gather(gather_output)

    @property
    def out_features_local(self) -> int:
        """Rows (output features) this rank holds."""
        return self.local_features

    def _set_gather(self, gather_output: bool) -> None:
        if gather_output and not self.is_balanced_share:
            raise ValueError(f"{self._name()}: gather_output=True needs this rank's rows to be "
                             f"its balanced share of out_features (rank {self.rank} of "
                             f"world_size={self.world_size}); these rows are "
                             f"{self.tp_layouts['weight'].segments}")
        self.gather_output = gather_output

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, world_size: int | None = None, rank: int | None = None,
        gather_output: bool = False, group: ProcessGroup | None = None,
    ) -> RowParallelLinear:
        """Build this rank's shard of an existing ``nn.Linear`` (copies only the slice).

        The full layer is not referenced afterwards, so it can be freed. Meta
        tensors stay on meta.

        Raises:
            ValueError: ``out_features`` is smaller than the world size.
        """
        layer = cls._cut(linear, world_size, rank, group)
        layer._set_gather(gather_output)
        return layer

    @classmethod
    def from_shards(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, in_features: int,
        out_features: int, world_size: int | None = None, rank: int | None = None,
        gather_output: bool = False, group: ProcessGroup | None = None,
        requires_grad: bool = True, layouts: dict[str, ParamLayout] | None = None,
    ) -> RowParallelLinear:
        """Wrap already-cut local tensors: ``weight`` ``(rows, in_features)``, ``bias`` ``(rows,)``.

        ``layouts`` say which rows of the full layer these are (packed
        projections, whole heads, replicated KV heads); the default is this
        rank's balanced share. ``out_features`` records the full size.
        """
        layer = cls._wrap(weight, bias, in_features, out_features, world_size, rank, group,
                          requires_grad, layouts)
        layer._set_gather(gather_output)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply this rank's rows: ``(..., in)`` -> ``(..., out/tp)`` or ``(..., out)``."""
        if self.world_size == 1:
            # No check on the hot path: F.linear validates, we only reword its error.
            try:
                return F.linear(x, self.weight, self.bias)
            except RuntimeError as err:
                mismatch = input_mismatch(self, x, self.in_features)
                if mismatch is None:
                    raise
                raise mismatch from err
        ref = self.__dict__[_GROUP]  # the weak group, read without a call (comm.group_ref)
        group = ref() if ref is not None else None
        if group is None and ref is not None:
            group = self.group  # destroyed: raises GroupDestroyedError, naming this layer
        if not x.dim() or x.shape[-1] != self.in_features:
            mismatch = input_mismatch(self, x, self.in_features)
            # Other ranks may be fine and already waiting in the collective: tell them.
            raise rank_local_error(group, mismatch)  # type: ignore[arg-type]
        needs_grad = x.requires_grad and torch.is_grad_enabled()
        if group is None and x.requires_grad:
            raise MissingProcessGroupError(
                f"{self._name()}: the input gradient needs an all-reduce across "
                f"world_size={self.world_size} ranks but no process group is running; "
                f"{launch_hint(self.world_size)} (or run under torch.no_grad())")
        if self.sequence_dim is not None:
            # The gather before us reduce-scatters the input gradient; this saves the
            # sequence shard x was gathered from, not x.
            y = linear_on_gathered(x, self.weight, self.bias, self.overlap)  # (B, T, out/tp)
        elif needs_grad and group is not None and not torch.compiler.is_compiling() \
                and _overlap.enabled("grad_reduce", self.overlap, x.device):
            # The input-gradient all-reduce runs beside the weight gradient.
            y = linear_reducing_input_grad(x, self.weight, self.bias, group)  # (..., out/tp)
        else:
            if needs_grad and group is not None:  # identity forward, all-reduce backward
                x = copy_to_tensor_parallel_region(x, group)
            y = F.linear(x, self.weight, self.bias)  # (..., out/tp)
        if self.gather_output:
            group = require_group(self._name, group, self.world_size)
            y = gather_from_tensor_parallel_region(y, group, -1, self.out_features)  # (..., out)
        elif self.training and (TRACKER.depth or self.streamed):  # a split region begins
            # (in a wrapped training forward or its recomputation; see layers/rng.py)
            self.__dict__["streamed"] = split_region_begins(self)
        return y

    def extra_repr(self) -> str:
        return f"{self._split_repr()}, gather_output={self.gather_output}"
