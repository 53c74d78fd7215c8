"""ParallelLinear: what RowParallelLinear and ColumnParallelLinear share.

Placement (group, world size, rank), the size check, same-seed
initialisation, building from an ``nn.Linear`` or from already-cut tensors,
and the layouts the layer owns. The subclasses add only their split
dimension and their forward.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import nn

from ..comm.devices import default_device
from ..comm.group_ref import WeakGroup
from ..comm.runtime import ProcessGroup
from ..core.layouts import ParamLayout, shard_range
from ._base import check_splittable, full_linear, linear_layouts, resolve_placement
from .owned import ShardedModule

L = TypeVar("L", bound="ParallelLinear")


class ParallelLinear(ShardedModule, nn.Module):
    """Base of the parallel Linear layers; weight layout ``(out_features, in_features)``.

    Subclasses set ``split_dim``: 0 splits weight rows (``out_features``), 1
    splits weight columns (``in_features``). Sizes need not divide by the
    world size: rank shares follow the balanced rule of
    :func:`torchtp.core.layouts.shard_sizes` (they differ by at most one).

    Attributes:
        tp_layouts: ``{"weight": ..., "bias": ...}``: which slice of the full
            ``nn.Linear`` tensors this rank holds (read it with
            :func:`torchtp.layers.layouts_of`).
        overlap: Overlap the layer's communication with its computation
            (:mod:`torchtp.comm.overlap`); ``None`` follows ``TP_OVERLAP``,
            else the measured default. Each subclass says what it overlaps.
    """

    split_dim: int = 0
    overlap: bool | None = None
    # Whether its last training forward switched the RNG streams (it ran inside a wrapped
    # model's training forward): its recomputation then switches them too (layers/rng.py).
    streamed: bool = False
    # Its name in the wrapped model, hashed (set by the wrapper): the key of the local RNG
    # stream a split region it opens starts (layers/rng.py).
    stream_key: int = 0
    weight: nn.Parameter
    bias: nn.Parameter | None
    group: WeakGroup[ProcessGroup | None] = WeakGroup()  # held weakly (comm.group_ref)
    world_size: int
    rank: int
    in_features: int
    out_features: int

    def __init__(
        self, in_features: int, out_features: int, bias: bool,
        world_size: int | None, rank: int | None, dtype: torch.dtype | None,
        device: torch.device | str | None, group: ProcessGroup | None,
    ) -> None:
        super().__init__()
        who = self._describe(in_features, out_features)
        self.group, self.world_size, self.rank = resolve_placement(who, world_size, rank, group)
        self._check(who, in_features, out_features, self.world_size)
        layouts = linear_layouts(in_features, out_features, bias, self.split_dim,
                                 self.world_size, self.rank)
        self._own(in_features, out_features, layouts)
        device = default_device(device)  # the rank's device (cuda:LOCAL_RANK under NCCL)
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(layouts["weight"].local_shape, **kw))
        self.bias = nn.Parameter(torch.empty(layouts["bias"].local_shape, **kw)) if bias else None
        if device.type != "meta":
            full = full_linear(in_features, out_features, bias, dtype, device)
            with torch.no_grad():
                for name, layout in layouts.items():
                    getattr(self, name).copy_(layout.take(getattr(full, name)))

    @classmethod
    def _describe(cls, in_features: int, out_features: int) -> str:
        return f"{cls.__name__}(in_features={in_features}, out_features={out_features})"

    @classmethod
    def _check(cls, who: str, in_features: int, out_features: int, world_size: int) -> None:
        if cls.split_dim == 0:
            check_splittable(who, "out_features", out_features, world_size, "weight row")
        else:
            check_splittable(who, "in_features", in_features, world_size, "weight column")

    def _own(self, in_features: int, out_features: int, layouts: dict[str, ParamLayout]) -> None:
        self.in_features = in_features
        self.out_features = out_features
        self.tp_layouts = layouts

    @property
    def local_features(self) -> int:
        """Size of this rank's share of the split dimension."""
        return self.tp_layouts["weight"].local_shape[self.split_dim]

    @property
    def is_balanced_share(self) -> bool:
        """Whether this rank holds one contiguous balanced share (gathers and scatters need it)."""
        full = self.out_features if self.split_dim == 0 else self.in_features
        return self.tp_layouts["weight"].segments == (
            shard_range(full, self.world_size, self.rank),)

    @classmethod
    def _cut(cls: type[L], linear: nn.Linear, world_size: int | None, rank: int | None,
             group: ProcessGroup | None) -> L:
        who = f"{cls.__name__}.from_linear({linear})"
        _, size, me = resolve_placement(who, world_size, rank, group)
        cls._check(who, linear.in_features, linear.out_features, size)
        layouts = linear_layouts(linear.in_features, linear.out_features, linear.bias is not None,
                                 cls.split_dim, size, me)
        bias = None if linear.bias is None else layouts["bias"].take(linear.bias)
        return cls._wrap(layouts["weight"].take(linear.weight), bias, linear.in_features,
                         linear.out_features, world_size, rank, group,
                         linear.weight.requires_grad, layouts)

    @classmethod
    def _wrap(cls: type[L], weight: torch.Tensor, bias: torch.Tensor | None, in_features: int,
              out_features: int, world_size: int | None, rank: int | None,
              group: ProcessGroup | None, requires_grad: bool,
              layouts: dict[str, ParamLayout] | None) -> L:
        """An instance holding already-cut tensors, without running ``__init__``.

        ``__init__`` would allocate and initialise the parameters only to throw
        them away. ``layouts`` default to this rank's balanced share.

        Raises:
            ValueError: a tensor's shape is not the one its layout gives.
        """
        who = cls._describe(in_features, out_features)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.group, layer.world_size, layer.rank = resolve_placement(
            who, world_size, rank, group)
        if layouts is None:
            cls._check(who, in_features, out_features, layer.world_size)
            layouts = linear_layouts(in_features, out_features, bias is not None, cls.split_dim,
                                     layer.world_size, layer.rank)
        for name, t in (("weight", weight), ("bias", bias)):
            want = layouts[name].local_shape if name in layouts else None
            if t is not None and want is not None and tuple(t.shape) != want:
                raise ValueError(f"{who}: {name} shard has shape {tuple(t.shape)} but its layout "
                                 f"on rank {layer.rank} of world_size={layer.world_size} gives "
                                 f"{want}")
        layer._own(in_features, out_features, layouts)
        layer.weight = nn.Parameter(weight, requires_grad=requires_grad)
        layer.bias = None if bias is None else nn.Parameter(bias, requires_grad=requires_grad)
        return layer

    def _name(self) -> str:
        return self._describe(self.in_features, self.out_features)

    def _split_repr(self) -> str:
        dim, full = (("out_features", self.out_features) if self.split_dim == 0
                     else ("in_features", self.in_features))
        what = "weight rows" if self.split_dim == 0 else "weight columns"
        even = full % self.world_size == 0 and self.is_balanced_share
        where = "per rank" if even else f"on rank {self.rank}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"split={what} ({dim} {full} -> {self.local_features} {where}), "
                f"world_size={self.world_size}, rank={self.rank}, bias={self.bias is not None}")
