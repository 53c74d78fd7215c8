"""RowParallelLinear: splits the weight's rows (out_features) across ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..devices import default_device
from ..errors import MissingProcessGroupError, launch_hint
from ..regions import copy_to_tensor_parallel_region, gather_from_tensor_parallel_region, rank_local_error
from ..runtime import ProcessGroup
from ._base import (
    check_divisible,
    full_linear,
    new_from_shards,
    require_group,
    resolve_placement,
    take_shard,
)
from ._shape import input_mismatch


class RowParallelLinear(nn.Module):
    """A Linear whose weight *rows* (``out_features``) are split across ranks.

    The weight has PyTorch's layout ``(out_features, in_features)``; rank ``r``
    holds rows ``r*out/tp : (r+1)*out/tp`` and the matching bias entries. Every
    rank sees the full input and produces its slice of the output features, so
    the forward needs no communication. Megatron calls this
    ``ColumnParallelLinear`` and PyTorch/HF call it ``colwise``.

    forward: ``(..., in_features)`` -> ``(..., out_features_local)``, or the
    full ``(..., out_features)`` with ``gather_output=True`` (one all-gather).
    backward: the input gradient is all-reduced (each rank's is a partial sum
    over its output slice).

    Args:
        in_features: Input features (not split).
        out_features: Total output features; must be divisible by ``world_size``.
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
            :func:`~torchtp.sequence_parallel.gather_for_tensor_parallel`, whose
            backward reduce-scatters the input gradient, so no all-reduce here.

    Raises:
        ValueError: ``out_features`` is not divisible by ``world_size`` (the
            message lists the valid sizes), or ``world_size``/``rank`` contradict
            the process group.
    """

    sequence_dim: int | None = None

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True,
        world_size: int | None = None, rank: int | None = None,
        dtype: torch.dtype | None = None, device: torch.device | str | None = None,
        gather_output: bool = False, group: ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        who = f"RowParallelLinear(in_features={in_features}, out_features={out_features})"
        self.group, self.world_size, self.rank = resolve_placement(who, world_size, rank, group)
        local = check_divisible(who, "out_features", out_features, self.world_size, "weight rows")
        self._set_shape(in_features, out_features, local, gather_output)
        device = default_device(device)  # the rank's device (cuda:LOCAL_RANK under NCCL)
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(local, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(local, **kw)) if bias else None
        if device.type != "meta":
            self._init_from(full_linear(in_features, out_features, bias, dtype, device))

    def _set_shape(self, in_features: int, out_features: int, local: int,
                   gather_output: bool) -> None:
        self.in_features = in_features
        self.out_features = out_features
        self.out_features_local = local
        self.gather_output = gather_output

    def _init_from(self, linear: nn.Linear) -> None:
        with torch.no_grad():
            self.weight.copy_(take_shard(linear.weight, 0, self.rank, self.world_size))
            if self.bias is not None:
                self.bias.copy_(take_shard(linear.bias, 0, self.rank, self.world_size))

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, world_size: int | None = None, rank: int | None = None,
        gather_output: bool = False, group: ProcessGroup | None = None,
    ) -> RowParallelLinear:
        """Build this rank's shard of an existing ``nn.Linear`` (copies only the slice).

        The full layer is not referenced afterwards, so it can be freed. Meta
        tensors stay on meta.

        Raises:
            ValueError: ``out_features`` is not divisible by the world size.
        """
        who = f"RowParallelLinear.from_linear({linear})"
        _, size, me = resolve_placement(who, world_size, rank, group)
        check_divisible(who, "out_features", linear.out_features, size, "weight rows")
        bias = linear.bias
        return cls.from_shards(
            take_shard(linear.weight, 0, me, size),
            None if bias is None else take_shard(bias, 0, me, size),
            linear.in_features, linear.out_features, world_size, rank, gather_output, group,
            requires_grad=linear.weight.requires_grad)

    @classmethod
    def from_shards(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, in_features: int,
        out_features: int, world_size: int | None = None, rank: int | None = None,
        gather_output: bool = False, group: ProcessGroup | None = None,
        requires_grad: bool = True,
    ) -> RowParallelLinear:
        """Wrap already-cut local tensors: ``weight`` ``(rows, in_features)``, ``bias`` ``(rows,)``.

        The rows may be any subset of the full layer's (packed projections,
        replicated KV heads); ``out_features`` records the full size.
        """
        who = f"RowParallelLinear(in_features={in_features}, out_features={out_features})"
        layer = new_from_shards(cls, who, weight, bias, world_size, rank, group, requires_grad)
        layer._set_shape(in_features, out_features, weight.shape[0], gather_output)
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
        if not x.dim() or x.shape[-1] != self.in_features:
            mismatch = input_mismatch(self, x, self.in_features)
            # Other ranks may be fine and already waiting in the collective: tell them.
            raise rank_local_error(self.group, mismatch)  # type: ignore[arg-type]
        # With sequence parallelism the gather before us reduce-scatters the input gradient.
        if self.group is not None and self.sequence_dim is None:
            x = copy_to_tensor_parallel_region(x, self.group)
        elif self.group is None and x.requires_grad:
            raise MissingProcessGroupError(
                f"{self._name()}: the input gradient needs an all-reduce across "
                f"world_size={self.world_size} ranks but no process group is running; "
                f"{launch_hint(self.world_size)} (or run under torch.no_grad())")
        y = F.linear(x, self.weight, self.bias)  # (..., out/tp)
        if self.gather_output:
            group = require_group(self._name(), self.group, self.world_size)
            y = gather_from_tensor_parallel_region(y, group, -1)  # (..., out)
        return y

    def _name(self) -> str:
        return (f"RowParallelLinear(in_features={self.in_features}, "
                f"out_features={self.out_features})")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"split=weight rows (out_features {self.out_features} -> "
                f"{self.out_features_local} per rank), world_size={self.world_size}, "
                f"rank={self.rank}, bias={self.bias is not None}, "
                f"gather_output={self.gather_output}")
