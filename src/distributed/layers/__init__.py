"""Parallel layers (Linear names follow the weight layout ``(out_features, in_features)``).

Every parallel layer owns the layouts of its parameters (which slice of the
full tensor it holds); read them with :func:`layouts_of`. The model-parallel
RNG streams (``rng``) live here too: the layers switch them where a split
region begins and ends.

Layer 2. May import: ``core``, ``comm``.
"""

from __future__ import annotations

from .column import ColumnParallelLinear as ColumnParallelLinear
from .embedding import FeatureParallelEmbedding as FeatureParallelEmbedding
from .embedding import VocabParallelEmbedding as VocabParallelEmbedding
from .embedding import VocabSplit
from .owned import ShardedModule
from .owned import layouts_of as layouts_of
from .parallel_linear import ParallelLinear
from .row import RowParallelLinear as RowParallelLinear

# The layers and layouts_of (``as`` above) are exported by ``torchtp`` itself:
# docs/api.md lists each name once; they stay importable from here, where they live.
__all__ = [
    "ParallelLinear",
    "ShardedModule",
    "VocabSplit",
]
