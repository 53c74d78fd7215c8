"""Size constraints: what a plan needs of the tp size.

Splits are balanced (:func:`torchtp.core.layouts.shard_sizes`), so nothing has to
divide; a split dimension only needs at least one unit (row, head, KV group)
per rank.

Every style and every attention module states its constraints as data, so a
failing check can list every tp size the *whole model* accepts, before any
weight is touched or any collective runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..core.layouts import valid_sizes


@dataclass(frozen=True)
class Constraint:
    """``value`` units must give every rank at least one (unless ``replicable``).

    Attributes:
        where: What the constraint belongs to, e.g. ``"module 'layers.0.mlp.up_proj' (style 'colwise')"``.
        what: The dimension, e.g. ``"out_features (weight rows)"``.
        value: Its full size in units.
        replicable: With more ranks than units the units are replicated on
            the ranks that share them (KV heads), so any tp fits.
    """

    where: str
    what: str
    value: int
    replicable: bool = False

    def ok(self, tp: int) -> bool:
        """Whether tp size ``tp`` satisfies the constraint."""
        return self.replicable or tp in valid_sizes(self.value)

    @property
    def bound(self) -> int | None:
        """The largest tp size it allows, or ``None`` (no upper bound)."""
        return None if self.replicable else self.value

    def problem(self, tp: int) -> str:
        """Sentence saying why ``tp`` fails."""
        return (f"{self.where}: {self.what}={self.value} cannot give each of world_size={tp} "
                "ranks at least one")


@dataclass(frozen=True)
class MultipleOf(Constraint):
    """The tp size must be a multiple of ``value`` (e.g. the expert-parallel ranks that
    ``expert_parallel=k`` factors out of the TP group)."""

    def ok(self, tp: int) -> bool:
        return tp % self.value == 0

    @property
    def bound(self) -> int | None:
        return None

    def problem(self, tp: int) -> str:
        return f"{self.where}: world_size={tp} is not a multiple of {self.what}={self.value}"


def valid_tp_sizes(constraints: Iterable[Constraint]) -> list[int]:
    """All tp sizes (up to :data:`torchtp.core.layouts.MAX_TP`) that satisfy every constraint."""
    items = list(constraints)
    bounds = [c.bound for c in items if c.bound is not None]
    return [tp for tp in valid_sizes(*bounds) if all(c.ok(tp) for c in items)]


def check(constraints: Iterable[Constraint], tp: int, model_name: str) -> None:
    """Raise a ValueError naming the first failing constraint and the valid sizes.

    Args:
        constraints: All constraints of the plan.
        tp: The tp size in use.
        model_name: The model's class name, for the message.
    """
    items = list(constraints)
    failing = [c for c in items if not c.ok(tp)]
    if not failing:
        return
    more = f" (and {len(failing) - 1} more)" if len(failing) > 1 else ""
    raise ValueError(
        f"{model_name}: {failing[0].problem(tp)}{more}; valid world sizes for this model: "
        f"{valid_tp_sizes(items)}; or mark the module 'replicate' in the plan")
