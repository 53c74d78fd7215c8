"""HuggingFace plan styles beyond plain colwise/rowwise.

* :class:`HeadSplit` - a projection whose output rows are made of parts
  (q/k/v heads, a fused ``qkv``/``gate_up``): each part is split on its own, so
  every rank gets matching slices; a part with fewer heads than ranks is
  replicated head by head on the ranks that use it (GQA with tp > KV heads).
* :class:`ReplicatedWithGradAllreduce` - a replicated module whose gradient is
  partial on each rank (Qwen3's per-head ``q_norm``/``k_norm``).
* :class:`EmbeddingRowwise` / :class:`EmbeddingColwise` - vocab- or
  feature-split embeddings.

Each follows the style contract of :mod:`torchtp.plans.styles`: ``plan`` once,
then ``apply``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from torch import nn

from ..grad_sync import GradSync, mark
from ..layers import FeatureParallelEmbedding, VocabParallelEmbedding
from ..layouts import head_share, shard_range, split_layout
from ..plans.constraints import Constraint
from ..plans.fidelity import embedding_splits_exactly
from ..plans.linear_view import LinearView
from ..plans.styles import Colwise, LayerPlan, ParallelStyle, Rowwise, ShardContext
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
        """This rank's ``(first unit, units)`` (whole heads; see :func:`torchtp.layouts.head_share`)."""
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
        where = f"module '{fqn}' (style {self.name!r})"
        return [Constraint(where, p.name, p.units, replicable=p.replicable)
                for p in self.parts_for(view.out_features)]

    def row_segments(self, view: LinearView, ctx: ShardContext) -> tuple[tuple[int, int], ...]:
        segments, offset = [], 0
        for part in self.parts_for(view.out_features):
            segments.append(part.segment(offset, ctx))
            offset += part.size
        return tuple(segments)

    def detail(self, view: LinearView) -> str:
        parts = self.parts_for(view.out_features)
        return "split part by part: " + ", ".join(f"{p.units} {p.name}" for p in parts)

    def apply(self, module: nn.Module, layer: LayerPlan, ctx: ShardContext) -> nn.Module:
        swapped = super().apply(module, layer, ctx)
        shared, local = [], 0
        segments = layer.layouts["weight"].segments
        for part, (_, n) in zip(self.parts_for(layer.full[0]), segments, strict=True):
            if part.is_kv and part.units < ctx.world_size:
                # A replicated KV head: each rank's gradient covers only its own
                # query heads; the sum over the ranks sharing the head is exact.
                shared.append(GradSync(sharing_subgroup(ctx, part.units), (local, n)))
            local += n
        if shared:
            for name, _ in swapped.named_parameters(recurse=False):
                mark(swapped, name, tuple(shared))
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


class ReplicatedWithGradAllreduce(ParallelStyle):
    """Keep the module whole; sum its parameter gradients over the TP group.

    For modules applied to this rank's heads only (Qwen3's ``q_norm``/``k_norm``):
    the forward needs nothing, but each rank's gradient covers only its heads.
    """

    name = "replicated_with_grad_allreduce"

    def apply(self, module: nn.Module, layer: LayerPlan, ctx: ShardContext) -> nn.Module:
        if ctx.world_size > 1:
            for name, _ in module.named_parameters(recurse=False):
                mark(module, name, (GradSync(ctx.group),))
        return module


def _require_embedding(style: str, module: nn.Module, fqn: str) -> nn.Embedding:
    if not isinstance(module, nn.Embedding):
        raise TypeError(f"plan style {style!r} for module '{fqn}' needs an nn.Embedding, got "
                        f"{type(module).__name__}")
    if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
        raise ValueError(f"plan style {style!r} for module '{fqn}': max_norm, sparse and "
                         "scale_grad_by_freq embeddings are not supported; use 'replicate'")
    return module


def _embedding_plan(style: str, emb: nn.Embedding, fqn: str, ctx: ShardContext, dim: int,
                    collective: str) -> LayerPlan:
    """Plan an embedding split along ``dim`` of its ``(num_embeddings, embedding_dim)`` weight.

    ``dim`` 0 splits the vocabulary (weight rows), 1 the features (weight
    columns); fewer units than ranks leaves the plan with a constraint to report.
    """
    full = tuple(emb.weight.shape)
    what = ("num_embeddings (weight rows)", "embedding_dim (weight columns)")[dim]
    constraints = (Constraint(f"module '{fqn}' (style {style!r})", what, full[dim]),)
    if full[dim] < ctx.world_size:
        return LayerPlan(fqn, style, constraints, full, collectives=(collective,))
    layout = split_layout(full, dim, ctx.world_size, ctx.rank)
    return LayerPlan(fqn, style, constraints, full, layout.local_shape, {"weight": layout},
                     (collective,))


class EmbeddingRowwise(ParallelStyle):
    """Split the embedding's rows (the vocabulary): -> :class:`VocabParallelEmbedding`.

    Uneven vocabularies are fine (rank shares differ by at most one row).
    """

    name = "embedding_rowwise"

    def plan(self, module: nn.Module, fqn: str, ctx: ShardContext) -> LayerPlan:
        emb = _require_embedding(self.name, module, fqn)
        if type(emb).forward is not nn.Embedding.forward and \
                embedding_splits_exactly(emb, 2) is False:
            raise ValueError(
                f"style {self.name!r} for module '{fqn}' ({type(emb).__name__}): its forward "
                "adds work that does not commute with splitting the vocabulary (partial "
                "lookups would not sum to its output); mark it 'replicate'")
        return _embedding_plan(self.name, emb, fqn, ctx, 0, "all_reduce")

    def apply(self, module: nn.Module, layer: LayerPlan, ctx: ShardContext) -> nn.Module:
        # Subclasses (Gemma's scaled embedding) keep their own forward around the split.
        return VocabParallelEmbedding.from_embedding(cast(nn.Embedding, module), ctx.world_size,
                                                     ctx.rank, ctx.group)


class EmbeddingColwise(ParallelStyle):
    """Split the embedding's columns (embedding_dim): -> :class:`FeatureParallelEmbedding`."""

    name = "embedding_colwise"

    def plan(self, module: nn.Module, fqn: str, ctx: ShardContext) -> LayerPlan:
        emb = _require_embedding(self.name, module, fqn)
        if type(emb).forward is not nn.Embedding.forward:
            raise ValueError(f"style {self.name!r} for module '{fqn}' ({type(emb).__name__}): "
                             "embedding subclasses with their own forward can only be split "
                             "with 'embedding_rowwise' (or kept 'replicate')")
        return _embedding_plan(self.name, emb, fqn, ctx, 1, "all_gather")

    def apply(self, module: nn.Module, layer: LayerPlan, ctx: ShardContext) -> nn.Module:
        return FeatureParallelEmbedding.from_embedding(cast(nn.Embedding, module), ctx.world_size,
                                                       ctx.rank, ctx.group)
