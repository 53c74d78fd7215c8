"""Styles that split a projection by whole attention heads, or part by part.

* :class:`HeadSplit` - a projection whose output rows are made of parts
  (q/k/v heads, a fused ``qkv``/``gate_up``): each part is split on its own, so
  every rank gets matching slices; a part with fewer heads than ranks is
  replicated head by head on the ranks that use it (GQA with tp > KV heads).
* :class:`HeadColumns` - an attention output projection whose input columns
  follow the same whole query heads.
* :class:`HeadNorm` - an RMS norm over all the heads of a projection's output
  (OLMo-2's ``q_norm``/``k_norm``): its weight split like those rows, the mean
  of squares summed over the ranks.
* :class:`RopeKey` - multi-head latent attention's ``kv_a_proj_with_mqa``, whole,
  the gradient of the rope key every head reads summed over the ranks.

Nothing here is specific to one model family: HuggingFace's ``packed_colwise``
and the automatic plan's head splits of any model both use these. Each follows
the style contract of :mod:`torchtp.plans.styles`: ``plan`` once, then ``apply``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..core.layouts import ParamLayout, group_ranks, head_share, shard_range
from ..layers.grad_sync import GradSync, mark
from ..layers.owned import hold_shards
from ..layers.shared_by_heads import HeadShardedRMSNorm, SharedFeaturesEntry
from .constraints import Constraint
from .linear_view import LinearView
from .styles import Colwise, LayerPlan, ParallelStyle, Rowwise, ShardContext, require_linear
from .subgroups import sharing_subgroup


@dataclass(frozen=True)
class Part:
    """One fused part of a projection's output rows: ``size`` rows in ``units`` heads (or rows).

    Attributes:
        size: Rows of the part.
        units: Whole units (heads, or rows) the part is split by.
        name: The dimension, for messages.
        kv_groups: For attention heads, the number of KV groups the units fall
            into (a rank's query heads must share its KV heads); 0 for plain units.
        is_kv: The part holds one KV head per group (replicated on the ranks
            that share it when there are more ranks than KV heads).
    """

    size: int
    units: int
    name: str = "part"
    kv_groups: int = 0
    is_kv: bool = False

    @property
    def replicable(self) -> bool:
        """KV heads fit any tp: with more ranks than KV heads they are replicated.

        The query heads' part (at least one per rank) sets the real limit.
        """
        return self.is_kv

    def unit_range(self, ctx: ShardContext) -> tuple[int, int]:
        """This rank's ``(first unit, units)`` (whole heads; see :func:`torchtp.core.layouts.head_share`)."""
        if not self.kv_groups:
            return shard_range(self.units, ctx.world_size, ctx.rank)
        heads = self.kv_groups if self.is_kv else self.units  # a KV part: one head per group
        query, kv = head_share(heads, self.kv_groups, ctx.world_size, ctx.rank)
        return kv if self.is_kv else query

    def segment(self, offset: int, ctx: ShardContext) -> tuple[int, int]:
        """This rank's rows of the part, in full-tensor coordinates."""
        unit = self.size // self.units
        start, n = self.unit_range(ctx)
        return offset + start * unit, n * unit


def part_segments(parts: tuple[Part, ...], ctx: ShardContext) -> tuple[tuple[int, int], ...]:
    """This rank's rows of each of ``parts`` (stacked in order), in full-tensor coordinates."""
    segments, offset = [], 0
    for part in parts:
        segments.append(part.segment(offset, ctx))
        offset += part.size
    return tuple(segments)


def part_constraints(fqn: str, style: str, parts: tuple[Part, ...]) -> tuple[Constraint, ...]:
    """What each part needs of the tp size, attributed to one module and style."""
    return tuple(Constraint(f"module '{fqn}' (style {style!r})", p.name, p.units,
                            replicable=p.replicable) for p in parts)


def shared_part_syncs(parts: tuple[Part, ...], ctx: ShardContext) -> tuple[GradSync, ...]:
    """Gradient sums for this rank's rows of every replicated part (``is_kv`` past its units).

    A replicated KV head (or B/C group): each rank's gradient covers only its own
    query heads; the sum over the ranks sharing the head is exact. The condition is
    the same on every rank, so every rank asks for the sub-groups (a collective).
    """
    syncs, local = [], 0
    for part in parts:
        n = part.unit_range(ctx)[1] * (part.size // part.units)
        if part.is_kv and part.units < ctx.world_size:
            syncs.append(GradSync(sharing_subgroup(ctx, part.units), (local, n)))
        local += n
    return tuple(syncs)


class HeadSplit(Colwise):
    """Split each fused part of a projection's output rows separately.

    Args:
        parts: The output rows' parts, in order; ``None`` means two equal
            halves (HF's ``packed_colwise`` for a fused ``gate_up_proj``).
        name: The plan style this came from (``"colwise"``, ``"packed_colwise"``).
    """

    def __init__(self, parts: tuple[Part, ...] | None = None, name: str = "packed_colwise") -> None:
        super().__init__(gather_output=False)
        self.parts = parts
        self.name = name

    def parts_for(self, out_features: int) -> tuple[Part, ...]:
        """The parts, inferring two equal halves when none were given."""
        if self.parts is not None:
            return self.parts
        half = out_features // 2
        return (Part(half, half, "first half of the packed out_features (weight rows)"),
                Part(out_features - half, half,
                     "second half of the packed out_features (weight rows)"))

    def check(self, view: LinearView, module: nn.Module, fqn: str) -> None:
        super().check(view, module, fqn)
        sizes = [p.size for p in self.parts_for(view.out_features)]
        if sum(sizes) != view.out_features or (self.parts is None and view.out_features % 2):
            raise ValueError(
                f"style {self.name!r} for module '{fqn}': its out_features={view.out_features} "
                f"(weight rows) do not split into the packed parts {sizes}; a packed projection "
                "stacks equal parts (e.g. gate and up) along out_features")

    def constraints(self, view: LinearView, fqn: str) -> list[Constraint]:
        return list(part_constraints(fqn, self.name, self.parts_for(view.out_features)))

    def row_segments(self, view: LinearView, ctx: ShardContext) -> tuple[tuple[int, int], ...]:
        return part_segments(self.parts_for(view.out_features), ctx)

    def detail(self, view: LinearView) -> str:
        parts = self.parts_for(view.out_features)
        return "split part by part: " + ", ".join(f"{p.units} {p.name}" for p in parts)

    def apply(self, module: nn.Module, layer: LayerPlan, ctx: ShardContext) -> nn.Module:
        swapped = super().apply(module, layer, ctx)
        shared = shared_part_syncs(self.parts_for(layer.full[0]), ctx)
        if shared:
            for name, _ in swapped.named_parameters(recurse=False):
                mark(swapped, name, shared)
        return swapped


class HeadColumns(Rowwise):
    """Split an attention output projection's input columns by whole query heads.

    The columns follow the query heads this rank holds (the ``q`` part of the
    matching :class:`HeadSplit`), which differ from a balanced split of the
    columns when the heads do not divide by tp.

    Args:
        heads: The query heads' part (its ``size`` is the projection's in_features).
        name: The plan style this came from (``"rowwise"``).
    """

    def __init__(self, heads: Part, name: str = "rowwise") -> None:
        super().__init__(split_input=False)
        self.heads = heads
        self.name = name

    def constraints(self, view: LinearView, fqn: str) -> list[Constraint]:
        return [Constraint(f"module '{fqn}' (style {self.name!r})", self.heads.name,
                           self.heads.units)]

    def column_segments(self, view: LinearView, ctx: ShardContext) -> tuple[tuple[int, int], ...]:
        return (self.heads.segment(0, ctx),)

    def detail(self, view: LinearView) -> str:
        return f"input columns split by whole heads: {self.heads.units} {self.heads.name}"


def norm_epsilon(module: nn.Module) -> float | None:
    """An RMS norm's epsilon (``variance_epsilon`` or ``eps``), or None when it has none."""
    for attr in ("variance_epsilon", "eps"):
        value = getattr(module, attr, None)
        if isinstance(value, float):
            return value
    return None


class HeadNorm(ParallelStyle):
    """Split an RMS norm over all of a projection's heads like the projection's rows.

    The norm's weight ``(heads * head_dim,)`` keeps this rank's heads, and the
    forward (:class:`~torchtp.layers.shared_by_heads.HeadShardedRMSNorm`) sums the
    squares of the rank's shard over the group: one all-reduce of a ``(B, T, 1)``
    tensor per call, forward and backward. The plan probe runs the same
    arithmetic (:func:`~torchtp.layers.shared_by_heads.rms_norm_of_shard`) before
    anything is cut, so a norm that is not an RMS norm of this form keeps its
    attention replicated.

    Args:
        part: The projection's part this norm normalises (query or KV heads).
        source: The projection whose output it reads (the probe's reference).
    """

    name = "head_norm"

    def __init__(self, part: Part, source: str) -> None:
        self.part = part
        self.source = source

    def plan(self, module: nn.Module, fqn: str, ctx: ShardContext) -> LayerPlan:
        weight = getattr(module, "weight", None)
        if (not isinstance(weight, torch.Tensor) or weight.dim() != 1
                or weight.shape[0] != self.part.size or norm_epsilon(module) is None):
            raise TypeError(f"plan style {self.name!r} for module '{fqn}' "
                            f"({type(module).__name__}) needs an RMS norm with a 1-D weight of "
                            f"{self.part.size} features ({self.part.name}) and an epsilon")
        constraints = (Constraint(f"module '{fqn}' (style {self.name!r})", self.part.name,
                                  self.part.units, replicable=self.part.replicable),)
        full = (self.part.size,)
        if not all(c.ok(ctx.world_size) for c in constraints):
            return LayerPlan(fqn, self.name, constraints, full, collectives=("all_reduce",))
        layout = ParamLayout(full, 0, (self.part.segment(0, ctx),))
        return LayerPlan(fqn, self.name, constraints, full, layout.local_shape,
                         {"weight": layout}, ("all_reduce",),
                         f"weight split like '{self.source}' ({self.part.units} "
                         f"{self.part.name}); the mean of squares over all heads summed over the "
                         "ranks (one all-reduce of (B, T, 1))")

    def sharing(self, ctx: ShardContext) -> int:
        """How many ranks hold this rank's heads (more ranks than KV heads), else 1."""
        if not self.part.is_kv or self.part.units >= ctx.world_size:
            return 1
        return next(len(r) for r in group_ranks(self.part.units, ctx.world_size)
                    if ctx.rank in r)

    def apply(self, module: nn.Module, layer: LayerPlan, ctx: ShardContext) -> nn.Module:
        if ctx.world_size == 1 or not layer.layouts:
            return module
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        eps = norm_epsilon(module)
        assert eps is not None  # plan() checked it
        local = nn.Parameter(layer.layouts["weight"].take(weight),
                             requires_grad=weight.requires_grad)
        sharing = self.sharing(ctx)
        swapped = HeadShardedRMSNorm(local, eps, self.part.size, 1.0 / sharing, ctx.group,
                                     ctx.world_size, dict(layer.layouts), layer.fqn)
        if sharing > 1:  # a replicated KV head: each rank's gradient covers its query heads
            mark(swapped, "weight", (GradSync(sharing_subgroup(ctx, self.part.units),
                                              (0, local.shape[0])),))
        return swapped


def shared_rope(attention: nn.Module) -> tuple[int, int] | None:
    """``(kv_lora_rank, qk_rope_head_dim)`` of a multi-head latent attention, else None."""
    latent = getattr(attention, "kv_lora_rank", None)
    rope = getattr(attention, "qk_rope_head_dim", None)
    if isinstance(latent, int) and isinstance(rope, int) and latent > 0 and rope > 0:
        return latent, rope
    return None


class RopeKey(ParallelStyle):
    """A latent attention's ``kv_a_proj_with_mqa``: whole on every rank; the gradient of
    its rope features, one key shared by every head, summed over the ranks.

    HF's ``mla_kv_a_proj``. The rope width comes from the attention module
    (:func:`shared_rope`) when torchtp splits its heads; with the heads whole,
    every rank computes every head and the style keeps the module as it is.

    Args:
        rope: The rope features at the end of the output (``None``: not resolved yet).
    """

    name = "mla_kv_a_proj"

    def __init__(self, rope: int | None = None) -> None:
        self.rope = rope

    def plan(self, module: nn.Module, fqn: str, ctx: ShardContext) -> LayerPlan:
        view = require_linear(self.name, module, fqn)
        shape = (view.out_features, view.in_features)
        return LayerPlan(fqn, self.name, full=shape, local=shape)

    def apply(self, module: nn.Module, layer: LayerPlan, ctx: ShardContext) -> nn.Module:
        if ctx.world_size > 1 and self.rope is not None:
            entry = SharedFeaturesEntry(self.rope, ctx.group)
            module.register_forward_hook(entry)
            # A LoRA branch beside it adds to the same features: its B takes the same
            # hook (integrations/peft_shared.py), or its gradient would be this rank's part.
            module.tp_shared_output = entry  # type: ignore[assignment]
        return module


def head_parameters(module: nn.Module, heads: int) -> list[str]:
    """Names of ``module``'s own 1-D parameters with one value per query head (attention
    sinks: GPT-OSS's ``sinks``, Beam's ``gate_bias``), cut with its heads when they are split."""
    return [name for name, p in module.named_parameters(recurse=False)
            if p.dim() == 1 and p.shape[0] == heads]


class HeadParams(ParallelStyle):
    """Cut an attention module's own per-head parameters to this rank's query heads.

    GPT-OSS's, Granite-SWA's and MiMo-V2-Flash's attention ``sinks`` and Beam's
    ``gate_bias`` hold one value per query head, read by the module's forward
    beside the projections (:func:`head_parameters`). With the heads split each
    rank's forward runs its own heads only, so the parameter keeps those heads'
    values, cut by the one head rule: split, its gradient local, its layout in
    every checkpoint. HuggingFace names the style ``local_params`` (with
    ``"<attention>.sinks": "colwise"`` beside it, which it covers); the head split
    gives it to every head-split attention module holding such a parameter
    (:func:`torchtp.plans.head_split.cut_head_parameters`, the automatic plan), and
    without the heads' part (the heads stay whole) it keeps the module as it is.

    Args:
        heads: The module's query heads as a part (``plans.heads.query_part``), or
            ``None`` while its heads are not split.
    """

    name = "local_params"
    covers = ("*",)  # HF names the per-head parameter beside it ("<attention>.sinks")

    def __init__(self, heads: Part | None = None) -> None:
        self.heads = heads

    def plan(self, module: nn.Module, fqn: str, ctx: ShardContext) -> LayerPlan:
        if self.heads is None:
            return LayerPlan(fqn, self.name)
        first, count = self.heads.unit_range(ctx)  # this rank's query heads
        units = self.heads.units
        layouts = {n: ParamLayout((units,), 0, ((first, count),))
                   for n in head_parameters(module, units)}
        return LayerPlan(fqn, self.name, full=(units,), local=(count,),
                         layouts=layouts if ctx.world_size > 1 else {},
                         detail=f"{count} of {units} heads")

    def apply(self, module: nn.Module, layer: LayerPlan, ctx: ShardContext) -> nn.Module:
        if ctx.world_size == 1 or not layer.layouts:
            return module
        return hold_shards(module, dict(layer.layouts))


def head_params_reason(params: list[str] | tuple[str, ...]) -> str:
    """Why an attention module gets :class:`HeadParams`, for ``describe_plan()``."""
    return f"local_params: its per-head parameters {list(params)} keep this rank's heads"


def local_head_parameters(module: nn.Module, heads: Part, ctx: ShardContext
                          ) -> dict[str, torch.Tensor]:
    """This rank's cut of each per-head parameter, for the plan probes (which run the
    module's forward with its heads local before anything is cut)."""
    first, count = heads.unit_range(ctx)
    return {n: getattr(module, n).narrow(0, first, count)
            for n in head_parameters(module, heads.units)}
