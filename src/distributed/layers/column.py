"""ColumnParallelLinear: splits the weight's columns (in_features) across ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..devices import default_device
from ..regions import rank_local_error, reduce_from_tensor_parallel_region, scatter_to_tensor_parallel_region
from ..runtime import ProcessGroup
from ..sequence_parallel import reduce_scatter_to_sequence_shards
from ._base import (
    check_divisible,
    full_linear,
    new_from_shards,
    require_group,
    resolve_placement,
    take_shard,
)
from ._shape import input_mismatch


class ColumnParallelLinear(nn.Module):
    """A Linear whose weight *columns* (``in_features``) are split across ranks.

    The weight has PyTorch's layout ``(out_features, in_features)``; rank ``r``
    holds columns ``r*in/tp : (r+1)*in/tp`` and multiplies them with its slice
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
        in_features: Total input features; must be divisible by ``world_size``.
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

    Raises:
        ValueError: ``in_features`` is not divisible by ``world_size`` (the
            message lists the valid sizes), or ``world_size``/``rank`` contradict
            the process group.
    """

    sequence_dim: int | None = None

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True,
        world_size: int | None = None, rank: int | None = None,
        dtype: torch.dtype | None = None, device: torch.device | str | None = None,
        input_is_parallel: bool = True, group: ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        who = f"ColumnParallelLinear(in_features={in_features}, out_features={out_features})"
        self.group, self.world_size, self.rank = resolve_placement(who, world_size, rank, group)
        local = check_divisible(who, "in_features", in_features, self.world_size, "weight columns")
        self._set_shape(in_features, out_features, local, input_is_parallel)
        device = default_device(device)  # the rank's device (cuda:LOCAL_RANK under NCCL)
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(out_features, local, **kw))
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        if device.type != "meta":
            self._init_from(full_linear(in_features, out_features, bias, dtype, device))

    def _set_shape(self, in_features: int, out_features: int, local: int,
                   input_is_parallel: bool) -> None:
        self.in_features = in_features
        self.out_features = out_features
        self.in_features_local = local
        self.input_is_parallel = input_is_parallel

    def _init_from(self, linear: nn.Linear) -> None:
        with torch.no_grad():
            self.weight.copy_(take_shard(linear.weight, 1, self.rank, self.world_size))
            if self.bias is not None:
                self.bias.copy_(linear.bias)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, world_size: int | None = None, rank: int | None = None,
        input_is_parallel: bool = True, group: ProcessGroup | None = None,
    ) -> ColumnParallelLinear:
        """Build this rank's shard of an existing ``nn.Linear`` (copies only the slice).

        The full layer is not referenced afterwards, so it can be freed. Meta
        tensors stay on meta.

        Raises:
            ValueError: ``in_features`` is not divisible by the world size.
        """
        who = f"ColumnParallelLinear.from_linear({linear})"
        _, size, me = resolve_placement(who, world_size, rank, group)
        check_divisible(who, "in_features", linear.in_features, size, "weight columns")
        bias = linear.bias
        return cls.from_shards(
            take_shard(linear.weight, 1, me, size),
            None if bias is None else take_shard(bias, 0, 0, 1),
            linear.in_features, linear.out_features, world_size, rank, input_is_parallel, group,
            requires_grad=linear.weight.requires_grad)

    @classmethod
    def from_shards(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, in_features: int,
        out_features: int, world_size: int | None = None, rank: int | None = None,
        input_is_parallel: bool = True, group: ProcessGroup | None = None,
        requires_grad: bool = True,
    ) -> ColumnParallelLinear:
        """Wrap already-cut local tensors: ``weight`` ``(out_features, cols)``, full ``bias``."""
        who = f"ColumnParallelLinear(in_features={in_features}, out_features={out_features})"
        layer = new_from_shards(cls, who, weight, bias, world_size, rank, group, requires_grad)
        layer._set_shape(in_features, out_features, weight.shape[1], input_is_parallel)
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
        if not x.dim() or x.shape[-1] != self.expected_input_features:
            mismatch = input_mismatch(self, x, self.expected_input_features)
            # Other ranks may be fine and already waiting in the collective: tell them.
            raise rank_local_error(self.group, mismatch)  # type: ignore[arg-type]
        group = require_group(self._name(), self.group, self.world_size)
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, group, -1)  # (..., in/tp)
        partial = F.linear(x, self.weight)  # (..., out), this rank's partial sum
        if self.sequence_dim is not None:  # (B, S, out): this rank's sequence shard
            y = reduce_scatter_to_sequence_shards(partial, group, self.sequence_dim)
        else:  # partial is our own temporary, so the all-reduce may write into it.
            y = reduce_from_tensor_parallel_region(partial, group, inplace=True)
        if self.bias is not None:
            # Once, after the sum, so its gradient equals nn.Linear's. In place: y is
            # our own all-reduced temporary and the matmul's backward does not need it.
            y = y.add_(self.bias)
        return y

    def _name(self) -> str:
        return (f"ColumnParallelLinear(in_features={self.in_features}, "
                f"out_features={self.out_features})")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"split=weight columns (in_features {self.in_features} -> "
                f"{self.in_features_local} per rank), world_size={self.world_size}, "
                f"rank={self.rank}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}")
