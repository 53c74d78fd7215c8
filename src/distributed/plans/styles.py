"""Parallel styles: small objects that turn one module into its TP form.

Style names keep their PyTorch/HF meaning, which is named after the
Megatron-style *math* split rather than the weight layout:

==========================  ==================================  ========================
style                       splits                              becomes
==========================  ==================================  ========================
``colwise``                 weight rows (out_features)          RowParallelLinear
``colwise_gather_output``   weight rows, output all-gathered    RowParallelLinear(gather)
``rowwise``                 weight columns (in_features)        ColumnParallelLinear
``rowwise_split_input``     weight columns, input split first   ColumnParallelLinear
``replicate``               nothing                             unchanged
==========================  ==================================  ========================

More styles (packed projections, embeddings, replicated norms) live in
:mod:`torchtp.plans.styles_hf`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..layers import ColumnParallelLinear, RowParallelLinear
from ..layouts import ParamLayout, even_chunks
from ..runtime import ProcessGroup
from .constraints import Constraint
from .fidelity import check_linear_forward
from .linear_view import LinearView, linear_view


@dataclass(frozen=True)
class ShardContext:
    """Where the shards go: the group, its size and this rank."""

    world_size: int
    rank: int
    group: ProcessGroup | None
    model_name: str = "model"


@dataclass(frozen=True)
class LayerShapes:
    """A planned swap's full and local weight shapes (for reports and rank checks)."""

    full: tuple[int, ...]
    local: tuple[int, ...]


class ParallelStyle:
    """Base class: one style, one job (check, describe, apply to one module)."""

    name: str = "style"

    def check_type(self, module: nn.Module, fqn: str) -> None:
        """Raise ``TypeError`` if this style cannot handle ``module``'s type."""

    def constraints(self, module: nn.Module, fqn: str) -> list[Constraint]:
        """What this style needs of the tp size for ``module``."""
        return []

    def shapes(self, module: nn.Module, ctx: ShardContext) -> LayerShapes:
        """Full and per-rank weight shapes after applying this style."""
        weight = getattr(module, "weight", None)
        shape = tuple(weight.shape) if weight is not None else ()
        return LayerShapes(shape, shape)

    def layouts(self, module: nn.Module, ctx: ShardContext) -> dict[str, ParamLayout]:
        """How each split parameter maps onto the full tensor (empty: all replicated)."""
        return {}

    def apply(self, module: nn.Module, fqn: str, ctx: ShardContext) -> nn.Module:
        """Return the module to put in place of ``module`` (may be ``module`` itself)."""
        return module

    def __repr__(self) -> str:
        return repr(self.name)


def require_linear(style: str, module: nn.Module, fqn: str) -> LinearView:
    """The module as a Linear (nn.Linear or GPT-2's Conv1D), or a TypeError."""
    view = linear_view(module)
    if view is None:
        raise TypeError(f"plan style {style!r} for module '{fqn}' needs an nn.Linear (or a "
                        f"transformers Conv1D), got {type(module).__name__}; use 'replicate' "
                        "or remove the rule")
    return view


def split_constraint(style: str, fqn: str, dim: str, what: str, value: int) -> Constraint:
    """Constraint that ``value`` splits evenly, attributed to one module and style."""
    return Constraint(f"module '{fqn}' (style {style!r})", f"{dim} ({what})", value)


def attach_layouts(module: nn.Module, layouts: dict[str, ParamLayout]) -> nn.Module:
    """Record how each parameter of ``module`` maps onto the checkpoint tensor."""
    module.tp_layouts = layouts  # type: ignore[assignment]
    return module


class Colwise(ParallelStyle):
    """Split weight rows (out_features): Linear -> :class:`RowParallelLinear`.

    Args:
        gather_output: All-gather the output so it is replicated (the HF
            ``colwise_gather_output`` style); otherwise it stays sharded.
    """

    def __init__(self, gather_output: bool = False) -> None:
        self.gather_output = gather_output
        self.name = "colwise_gather_output" if gather_output else "colwise"

    def check_type(self, module: nn.Module, fqn: str) -> None:
        require_linear(self.name, module, fqn)
        check_linear_forward(module, fqn, self.name)

    def constraints(self, module: nn.Module, fqn: str) -> list[Constraint]:
        view = require_linear(self.name, module, fqn)
        return [split_constraint(self.name, fqn, "out_features", "weight rows", view.out_features)]

    def shapes(self, module: nn.Module, ctx: ShardContext) -> LayerShapes:
        view = require_linear(self.name, module, "?")
        out, inp = view.out_features, view.in_features
        return LayerShapes((out, inp), (out // ctx.world_size, inp))

    def row_segments(self, view: LinearView, ctx: ShardContext) -> tuple[tuple[int, int], ...]:
        """Which output rows this rank keeps (subclasses pick other rows)."""
        return (even_chunks(view.out_features, ctx.world_size, ctx.rank),)

    def layouts(self, module: nn.Module, ctx: ShardContext) -> dict[str, ParamLayout]:
        view = require_linear(self.name, module, "?")
        return view.layouts(0, self.row_segments(view, ctx))

    def apply(self, module: nn.Module, fqn: str, ctx: ShardContext) -> nn.Module:
        view = require_linear(self.name, module, fqn)
        layouts = self.layouts(module, ctx)
        layer = RowParallelLinear.from_shards(
            layouts["weight"].take(view.checkpoint_weight),
            None if view.bias is None else layouts["bias"].take(view.bias),
            view.in_features, view.out_features, world_size=ctx.world_size, rank=ctx.rank,
            gather_output=self.gather_output, group=ctx.group,
            requires_grad=view.checkpoint_weight.requires_grad)
        return attach_layouts(layer, layouts)


class Rowwise(ParallelStyle):
    """Split weight columns (in_features): Linear -> :class:`ColumnParallelLinear`.

    Args:
        split_input: The input arrives replicated and is split first (the HF
            ``rowwise_split_input`` style); otherwise it is already sharded.
    """

    def __init__(self, split_input: bool = False) -> None:
        self.split_input = split_input
        self.name = "rowwise_split_input" if split_input else "rowwise"

    def check_type(self, module: nn.Module, fqn: str) -> None:
        require_linear(self.name, module, fqn)
        check_linear_forward(module, fqn, self.name)

    def constraints(self, module: nn.Module, fqn: str) -> list[Constraint]:
        view = require_linear(self.name, module, fqn)
        return [split_constraint(self.name, fqn, "in_features", "weight columns", view.in_features)]

    def shapes(self, module: nn.Module, ctx: ShardContext) -> LayerShapes:
        view = require_linear(self.name, module, "?")
        out, inp = view.out_features, view.in_features
        return LayerShapes((out, inp), (out, inp // ctx.world_size))

    def layouts(self, module: nn.Module, ctx: ShardContext) -> dict[str, ParamLayout]:
        view = require_linear(self.name, module, "?")
        segments = (even_chunks(view.in_features, ctx.world_size, ctx.rank),)
        return view.layouts(1, segments, bias_split=False)

    def apply(self, module: nn.Module, fqn: str, ctx: ShardContext) -> nn.Module:
        view = require_linear(self.name, module, fqn)
        layouts = self.layouts(module, ctx)
        layer = ColumnParallelLinear.from_shards(
            layouts["weight"].take(view.checkpoint_weight),
            None if view.bias is None else layouts["bias"].take(view.bias),
            view.in_features, view.out_features, world_size=ctx.world_size, rank=ctx.rank,
            input_is_parallel=not self.split_input, group=ctx.group,
            requires_grad=view.checkpoint_weight.requires_grad)
        return attach_layouts(layer, layouts)


class Replicate(ParallelStyle):
    """Keep the module whole on every rank."""

    name = "replicate"
