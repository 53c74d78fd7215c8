"""Plans: which module gets which parallel style (see :func:`resolve_plan`).

Layer 3, generic planning. May import: ``core``, ``costmodel``, ``comm``, ``layers``. Never
``hf``: model families (HuggingFace) plug in through :mod:`.sources`, which
loads the HuggingFace plug-in by name the first time a model that may be one
is planned (``tests/distributed/test_architecture.py`` checks both).
"""

from __future__ import annotations

from .apply import apply_plan
from .constraints import Constraint, check, valid_tp_sizes
from .files import load_plan_file
from .registry import STYLES, SUPPORTED, get_style
from .resolve import match_rules, resolve_plan
from .resolved import Plan, ResolvedPlan
from .styles import (
    Colwise,
    ParallelStyle,
    Replicate,
    ReplicatedWithGradAllreduce,
    Rowwise,
    ShardContext,
    Unsupported,
)
from .styles_embedding import EmbeddingColwise, EmbeddingRowwise
from .styles_heads import HeadSplit, Part

__all__ = [
    "STYLES",
    "SUPPORTED",
    "Colwise",
    "Constraint",
    "EmbeddingColwise",
    "EmbeddingRowwise",
    "HeadSplit",
    "ParallelStyle",
    "Part",
    "Plan",
    "Replicate",
    "ReplicatedWithGradAllreduce",
    "ResolvedPlan",
    "Rowwise",
    "ShardContext",
    "Unsupported",
    "apply_plan",
    "check",
    "get_style",
    "load_plan_file",
    "match_rules",
    "resolve_plan",
    "valid_tp_sizes",
]
