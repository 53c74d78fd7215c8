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
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..errors import valid_sizes
from ..layers import ColumnParallelLinear, RowParallelLinear
from ..runtime import ProcessGroup


@dataclass(frozen=True)
class ShardContext:
    """Where the shards go: the group, its size and this rank."""

    world_size: int
    rank: int
    group: ProcessGroup | None


@dataclass(frozen=True)
class LayerShapes:
    """A planned swap's full and local weight shapes (for reports and rank checks)."""

    full: tuple[int, ...]
    local: tuple[int, ...]


class ParallelStyle:
    """Base class: one style, one job (validate, describe, apply to one module)."""

    name: str = "style"

    def validate(self, module: nn.Module, fqn: str, ctx: ShardContext) -> None:
        """Raise ``TypeError``/``ValueError`` if this style cannot shard ``module``."""

    def shapes(self, module: nn.Module, ctx: ShardContext) -> LayerShapes:
        """Full and per-rank weight shapes after applying this style."""
        weight = getattr(module, "weight", None)
        shape = tuple(weight.shape) if weight is not None else ()
        return LayerShapes(shape, shape)

    def apply(self, module: nn.Module, fqn: str, ctx: ShardContext) -> nn.Module:
        """Return the module to put in place of ``module`` (may be ``module`` itself)."""
        return module

    def __repr__(self) -> str:
        return repr(self.name)


def _require_linear(style: str, module: nn.Module, fqn: str) -> nn.Linear:
    if not isinstance(module, nn.Linear):
        raise TypeError(f"plan style {style!r} for module '{fqn}' needs an nn.Linear, "
                        f"got {type(module).__name__}; use 'replicate' or remove the rule")
    return module


def _require_divisible(style: str, fqn: str, dim: str, what: str, value: int,
                       ctx: ShardContext) -> None:
    if value % ctx.world_size:
        raise ValueError(
            f"module '{fqn}' (style {style!r}): {dim}={value} ({what}) is not divisible by "
            f"world_size={ctx.world_size}; valid world sizes: {valid_sizes(value)}; "
            "or mark the module 'replicate' in the plan")


class Colwise(ParallelStyle):
    """Split weight rows (out_features): ``nn.Linear`` -> :class:`RowParallelLinear`.

    Args:
        gather_output: All-gather the output so it is replicated (the HF
            ``colwise_gather_output`` style); otherwise it stays sharded.
    """

    def __init__(self, gather_output: bool = False) -> None:
        self.gather_output = gather_output
        self.name = "colwise_gather_output" if gather_output else "colwise"

    def validate(self, module: nn.Module, fqn: str, ctx: ShardContext) -> None:
        lin = _require_linear(self.name, module, fqn)
        _require_divisible(self.name, fqn, "out_features", "weight rows", lin.out_features, ctx)

    def shapes(self, module: nn.Module, ctx: ShardContext) -> LayerShapes:
        out, inp = module.weight.shape
        return LayerShapes((out, inp), (out // ctx.world_size, inp))

    def apply(self, module: nn.Module, fqn: str, ctx: ShardContext) -> nn.Module:
        return RowParallelLinear.from_linear(module, ctx.world_size, ctx.rank,  # type: ignore[arg-type]
                                             gather_output=self.gather_output, group=ctx.group)


class Rowwise(ParallelStyle):
    """Split weight columns (in_features): ``nn.Linear`` -> :class:`ColumnParallelLinear`.

    Args:
        split_input: The input arrives replicated and is split first (the HF
            ``rowwise_split_input`` style); otherwise it is already sharded.
    """

    def __init__(self, split_input: bool = False) -> None:
        self.split_input = split_input
        self.name = "rowwise_split_input" if split_input else "rowwise"

    def validate(self, module: nn.Module, fqn: str, ctx: ShardContext) -> None:
        lin = _require_linear(self.name, module, fqn)
        _require_divisible(self.name, fqn, "in_features", "weight columns", lin.in_features, ctx)

    def shapes(self, module: nn.Module, ctx: ShardContext) -> LayerShapes:
        out, inp = module.weight.shape
        return LayerShapes((out, inp), (out, inp // ctx.world_size))

    def apply(self, module: nn.Module, fqn: str, ctx: ShardContext) -> nn.Module:
        return ColumnParallelLinear.from_linear(module, ctx.world_size, ctx.rank,  # type: ignore[arg-type]
                                                input_is_parallel=not self.split_input,
                                                group=ctx.group)


class Replicate(ParallelStyle):
    """Keep the module whole on every rank."""

    name = "replicate"


STYLES: dict[str, ParallelStyle] = {
    s.name: s
    for s in (Colwise(), Colwise(gather_output=True), Rowwise(), Rowwise(split_input=True),
              Replicate())
}


def get_style(style: str | ParallelStyle, fqn: str = "?") -> ParallelStyle:
    """Look up a style by name (or pass a style object through).

    Raises:
        ValueError: unknown style name; the message lists the valid ones.
    """
    if isinstance(style, ParallelStyle):
        return style
    if isinstance(style, str) and style in STYLES:
        return STYLES[style]
    raise ValueError(f"unknown plan style {style!r} for '{fqn}'; valid styles: "
                     + ", ".join(sorted(STYLES)))
