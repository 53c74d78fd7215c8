"""Parallel styles: small objects that turn one module into its TP form.

Every style has one contract with two steps:

1. :meth:`ParallelStyle.plan` checks the module and computes its
   :class:`LayerPlan` once (constraints on the tp size, full and local weight
   shapes, parameter layouts, collectives per forward). It touches no weight
   and never communicates, so plans work on meta-device models too.
2. :meth:`ParallelStyle.apply` cuts this rank's shards as the layer plan says
   and returns the module to put in place.

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

Whole-head splits live in :mod:`torchtp.plans.styles_heads`, embeddings in
:mod:`torchtp.plans.styles_embedding`, the sequence-parallel norm style in
:mod:`torchtp.sp.style`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from ..comm.group_ref import WeakGroup
from ..comm.runtime import ProcessGroup
from ..core.errors import UnsupportedStyleError
from ..core.layouts import ParamLayout, shard_range
from ..layers import ColumnParallelLinear, RowParallelLinear
from ..layers.grad_sync import GradSync, mark
from .constraints import Constraint
from .fidelity import check_linear_forward
from .linear_view import LinearView, linear_view


@dataclass(frozen=True)
class ShardContext:
    """Where the shards go: the group, its size and this rank."""

    world_size: int
    rank: int
    group: WeakGroup[ProcessGroup | None] = WeakGroup(required=True)  # held weakly (comm.group_ref)
    model_name: str = "model"


@dataclass(frozen=True)
class LayerPlan:
    """What one style does to one module at one tp size, computed once.

    Attributes:
        fqn: The module's name in the model.
        style: The style's name (``"colwise"``, ``"rowwise"``...).
        constraints: What the split needs of the tp size.
        full: The full weight's shape, ``(out_features, in_features)`` for Linears.
        local: This rank's weight shape; ``()`` when a constraint fails at this tp.
        layouts: How each split parameter maps onto the full tensor (empty when
            nothing is split or a constraint fails).
        collectives: Collectives one forward of the module issues.
        detail: How the split was refined (e.g. whole heads), for ``describe_plan()``.
    """

    fqn: str
    style: str
    constraints: tuple[Constraint, ...] = ()
    full: tuple[int, ...] = ()
    local: tuple[int, ...] = ()
    layouts: Mapping[str, ParamLayout] = field(default_factory=dict)
    collectives: tuple[str, ...] = ()
    detail: str = ""

    def fits(self, tp: int) -> bool:
        """Whether every constraint holds at tp size ``tp``."""
        return all(c.ok(tp) for c in self.constraints)


class ParallelStyle:
    """Base class: plan one module once, then apply the plan (keeps it whole by default)."""

    name: str = "style"
    # Parameters of the module that the style plans itself (name patterns): a plan's
    # rules for them (HF names ``...experts.gate_up_proj``) are covered, not unmatched.
    covers: tuple[str, ...] = ()

    def plan(self, module: nn.Module, fqn: str, ctx: ShardContext) -> LayerPlan:
        """Check ``module`` and compute its layer plan at ``ctx`` (no weight is touched).

        Raises:
            TypeError: the style does not fit the module's type.
            ValueError: the module cannot be split this way at all (any tp).
        """
        weight = getattr(module, "weight", None)
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else ()
        return LayerPlan(fqn, self.name, full=shape, local=shape)

    def apply(self, module: nn.Module, layer: LayerPlan, ctx: ShardContext) -> nn.Module:
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
    """Constraint that ``value`` gives every rank a share, attributed to one module and style."""
    return Constraint(f"module '{fqn}' (style {style!r})", f"{dim} ({what})", value)


class LinearStyle(ParallelStyle):
    """A split of a Linear-like module's weight; subclasses pick the dim and the ranges."""

    collectives: tuple[str, ...] = ()

    def plan(self, module: nn.Module, fqn: str, ctx: ShardContext) -> LayerPlan:
        view = require_linear(self.name, module, fqn)
        self.check(view, module, fqn)
        constraints = tuple(self.constraints(view, fqn))
        full = (view.out_features, view.in_features)
        if not all(c.ok(ctx.world_size) for c in constraints):
            return LayerPlan(fqn, self.name, constraints, full, collectives=self.collectives)
        layouts = self.layouts(view, ctx)
        return LayerPlan(fqn, self.name, constraints, full, layouts["weight"].local_shape,
                         layouts, self.collectives, self.detail(view))

    def check(self, view: LinearView, module: nn.Module, fqn: str) -> None:
        """Raise if the module's forward is not the plain linear map the swap computes."""
        check_linear_forward(module, fqn, self.name)

    def constraints(self, view: LinearView, fqn: str) -> list[Constraint]:
        """What the split needs of the tp size."""
        raise NotImplementedError

    def layouts(self, view: LinearView, ctx: ShardContext) -> dict[str, ParamLayout]:
        """How weight and bias map onto the full tensors on this rank."""
        raise NotImplementedError

    def detail(self, view: LinearView) -> str:
        """How the split was refined, for ``describe_plan()`` (empty: plain split)."""
        return ""


def _shards(module: nn.Module, layer: LayerPlan
            ) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """This rank's weight and bias cut from the module's (checkpoint-orientation) tensors,
    and whether the weight trains."""
    weight = module.weight
    bias = getattr(module, "bias", None)
    assert isinstance(weight, torch.Tensor)
    cut_bias = layer.layouts["bias"].take(bias) if isinstance(bias, torch.Tensor) else None
    return layer.layouts["weight"].take(weight), cut_bias, weight.requires_grad


class Colwise(LinearStyle):
    """Split weight rows (out_features): Linear -> :class:`RowParallelLinear`.

    Args:
        gather_output: All-gather the output so it is replicated (the HF
            ``colwise_gather_output`` style); otherwise it stays sharded.
    """

    def __init__(self, gather_output: bool = False) -> None:
        self.gather_output = gather_output
        self.name = "colwise_gather_output" if gather_output else "colwise"
        self.collectives = ("all_gather",) if gather_output else ()

    def constraints(self, view: LinearView, fqn: str) -> list[Constraint]:
        return [split_constraint(self.name, fqn, "out_features", "weight rows", view.out_features)]

    def row_segments(self, view: LinearView, ctx: ShardContext) -> tuple[tuple[int, int], ...]:
        """Which output rows this rank keeps (subclasses pick other rows)."""
        return (shard_range(view.out_features, ctx.world_size, ctx.rank),)

    def layouts(self, view: LinearView, ctx: ShardContext) -> dict[str, ParamLayout]:
        return view.layouts(0, self.row_segments(view, ctx))

    def apply(self, module: nn.Module, layer: LayerPlan, ctx: ShardContext) -> nn.Module:
        weight, bias, trains = _shards(module, layer)
        out, inp = layer.full
        swapped = RowParallelLinear.from_shards(
            weight, bias, inp, out, world_size=ctx.world_size, rank=ctx.rank,
            gather_output=self.gather_output, group=ctx.group, requires_grad=trains,
            layouts=dict(layer.layouts))
        return swapped


class Rowwise(LinearStyle):
    """Split weight columns (in_features): Linear -> :class:`ColumnParallelLinear`.

    Args:
        split_input: The input arrives replicated and is split first (the HF
            ``rowwise_split_input`` style); otherwise it is already sharded.
    """

    collectives: tuple[str, ...] = ("all_reduce",)

    def __init__(self, split_input: bool = False) -> None:
        self.split_input = split_input
        self.name = "rowwise_split_input" if split_input else "rowwise"

    def constraints(self, view: LinearView, fqn: str) -> list[Constraint]:
        return [split_constraint(self.name, fqn, "in_features", "weight columns", view.in_features)]

    def column_segments(self, view: LinearView, ctx: ShardContext) -> tuple[tuple[int, int], ...]:
        """Which input columns this rank keeps (subclasses pick other columns)."""
        return (shard_range(view.in_features, ctx.world_size, ctx.rank),)

    def layouts(self, view: LinearView, ctx: ShardContext) -> dict[str, ParamLayout]:
        return view.layouts(1, self.column_segments(view, ctx), bias_split=False)

    def apply(self, module: nn.Module, layer: LayerPlan, ctx: ShardContext) -> nn.Module:
        weight, bias, trains = _shards(module, layer)
        out, inp = layer.full
        swapped = ColumnParallelLinear.from_shards(
            weight, bias, inp, out, world_size=ctx.world_size, rank=ctx.rank,
            input_is_parallel=not self.split_input, group=ctx.group, requires_grad=trains,
            layouts=dict(layer.layouts))
        return swapped


class Replicate(ParallelStyle):
    """Keep the module whole on every rank."""

    name = "replicate"


class ReplicatedWithGradAllreduce(ParallelStyle):
    """Keep the module whole; sum its parameter gradients over the TP group.

    For modules applied to this rank's heads only (Qwen3's ``q_norm``/``k_norm``):
    the forward needs nothing, but each rank's gradient covers only its heads.
    """

    name = "replicated_with_grad_allreduce"

    def plan(self, module: nn.Module, fqn: str, ctx: ShardContext) -> LayerPlan:
        """Check that ``module`` holds the parameters it sums (not only submodules).

        Raises:
            ValueError: its parameters all sit in submodules (a wrapper around the
                module, such as PEFT's ``modules_to_save``): none would be summed.
        """
        if next(module.parameters(recurse=False), None) is None \
                and next(module.parameters(), None) is not None:
            raise ValueError(
                f"plan style {self.name!r} for module '{fqn}' ({type(module).__name__}): its "
                f"parameters' gradients must be summed over the TP group of {ctx.world_size} "
                "ranks, but it holds none of its own, only submodules "
                f"{[n for n, _ in module.named_children()]} (a wrapper around the module, such "
                "as PEFT's modules_to_save), so none would be summed; wrap the model without "
                "the wrapper and add it afterwards (get_peft_model(wrapped.base_model, <the "
                "same config>)), or give the style to the module holding the parameters")
        return super().plan(module, fqn, ctx)

    def apply(self, module: nn.Module, layer: LayerPlan, ctx: ShardContext) -> nn.Module:
        if ctx.world_size > 1:
            for name, _ in module.named_parameters(recurse=False):
                mark(module, name, (GradSync(ctx.group),))
            # A LoRA branch beside it is partial the same way (integrations/peft_shared.py)
            module.tp_summed_gradient = True  # type: ignore[assignment]
        return module


class Unsupported(ParallelStyle):
    """A style name torchtp knows but cannot honour: refuse instead of replicating."""

    def __init__(self, name: str, why: str) -> None:
        self.name = name
        self.why = why

    def plan(self, module: nn.Module, fqn: str, ctx: ShardContext) -> LayerPlan:
        raise UnsupportedStyleError(
            f"plan style {self.name!r} for module '{fqn}' ({type(module).__name__}) is not "
            f"supported by torchtp: {self.why}. torchtp does not silently replicate a module "
            "the plan asks to shard; override it with plan={...: 'replicate'} to keep it whole")
