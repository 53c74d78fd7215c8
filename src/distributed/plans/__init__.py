"""Plans: which module gets which parallel style."""

from __future__ import annotations

from .constraints import Constraint, check, valid_tp_sizes
from .files import load_plan_file
from .registry import STYLES, SUPPORTED, get_style
from .resolve import Plan, ResolvedPlan, match_plan
from .sequential import sequential_plan
from .styles import (
    Colwise,
    LayerShapes,
    ParallelStyle,
    Replicate,
    Rowwise,
    ShardContext,
)
from .styles_hf import (
    EmbeddingColwise,
    EmbeddingRowwise,
    HeadSplit,
    Part,
    ReplicatedWithGradAllreduce,
    Unsupported,
)

__all__ = [
    "STYLES",
    "SUPPORTED",
    "Colwise",
    "Constraint",
    "EmbeddingColwise",
    "EmbeddingRowwise",
    "HeadSplit",
    "LayerShapes",
    "ParallelStyle",
    "Part",
    "Plan",
    "Replicate",
    "ReplicatedWithGradAllreduce",
    "ResolvedPlan",
    "Rowwise",
    "ShardContext",
    "Unsupported",
    "check",
    "get_style",
    "load_plan_file",
    "match_plan",
    "sequential_plan",
    "valid_tp_sizes",
]
