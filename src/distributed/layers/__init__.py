"""Parallel layers (Linear names follow the weight layout ``(out_features, in_features)``).

Every parallel layer owns the layouts of its parameters (which slice of the
full tensor it holds); read them with :func:`layouts_of`.

Layer 2. May import: ``core``, ``comm``.
"""

from __future__ import annotations

from .column import ColumnParallelLinear
from .embedding import FeatureParallelEmbedding, VocabParallelEmbedding, VocabSplit
from .owned import ShardedModule, layouts_of
from .parallel_linear import ParallelLinear
from .row import RowParallelLinear

# The layers and layouts_of are exported by ``torchtp`` itself (docs/api.md lists
# each name once); they stay importable from here, where they are defined.
__all__ = [
    "ParallelLinear",
    "ShardedModule",
    "VocabSplit",
]
