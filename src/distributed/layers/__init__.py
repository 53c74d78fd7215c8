"""Parallel Linear layers (names follow the weight layout ``(out_features, in_features)``)."""

from __future__ import annotations

from .column import ColumnParallelLinear
from .row import RowParallelLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]
