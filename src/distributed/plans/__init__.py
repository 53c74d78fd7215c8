"""Plans: which module gets which parallel style."""

from __future__ import annotations

from .resolve import Plan, ResolvedPlan, match_plan
from .sequential import sequential_plan
from .styles import (
    STYLES,
    Colwise,
    LayerShapes,
    ParallelStyle,
    Replicate,
    Rowwise,
    ShardContext,
    get_style,
)

__all__ = [
    "STYLES",
    "Colwise",
    "LayerShapes",
    "ParallelStyle",
    "Plan",
    "Replicate",
    "ResolvedPlan",
    "Rowwise",
    "ShardContext",
    "get_style",
    "match_plan",
    "sequential_plan",
]
