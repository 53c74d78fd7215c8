"""Parallel Linear layers (names follow the weight layout ``(out_features, in_features)``)."""

from __future__ import annotations

from .column import ColumnParallelLinear
from .embedding import FeatureParallelEmbedding, VocabParallelEmbedding
from .row import RowParallelLinear

__all__ = [
    "ColumnParallelLinear",
    "FeatureParallelEmbedding",
    "RowParallelLinear",
    "VocabParallelEmbedding",
]
