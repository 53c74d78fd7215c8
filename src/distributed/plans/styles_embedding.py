"""Embedding styles: split the vocabulary (weight rows) or the features (weight columns).

* :class:`EmbeddingRowwise` (``embedding_rowwise``) -> :class:`~torchtp.layers.VocabParallelEmbedding`;
* :class:`EmbeddingColwise` (``embedding_colwise``) -> :class:`~torchtp.layers.FeatureParallelEmbedding`.

Each follows the style contract of :mod:`torchtp.plans.styles`.
"""

from __future__ import annotations

from typing import cast

from torch import nn

from ..core.layouts import split_layout
from ..layers import FeatureParallelEmbedding, VocabParallelEmbedding
from .constraints import Constraint
from .fidelity import embedding_splits_exactly
from .styles import LayerPlan, ParallelStyle, ShardContext


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
