"""Divisibility constraints: what a plan needs of the tp size.

Every style and every attention module states its constraints as data, so a
failing check can list every tp size the *whole model* accepts, before any
weight is touched or any collective runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MAX_TP = 64


@dataclass(frozen=True)
class Constraint:
    """``value`` must be divisible by tp (or, with ``allow_multiple``, divide it).

    Attributes:
        where: What the constraint belongs to, e.g. ``"module 'layers.0.mlp.up_proj' (style 'colwise')"``.
        what: The dimension, e.g. ``"out_features (weight rows)"``.
        value: Its full size.
        allow_multiple: Also accept tp that is a multiple of ``value`` (KV heads
            are then replicated on the ranks that share them).
    """

    where: str
    what: str
    value: int
    allow_multiple: bool = False

    def ok(self, tp: int) -> bool:
        """Whether tp size ``tp`` satisfies the constraint."""
        return self.value % tp == 0 or (self.allow_multiple and tp % self.value == 0)

    def problem(self, tp: int) -> str:
        """Sentence saying why ``tp`` fails."""
        if self.allow_multiple:
            return (f"{self.where}: {self.what}={self.value} is neither divisible by "
                    f"world_size={tp} nor a divisor of it")
        return f"{self.where}: {self.what}={self.value} is not divisible by world_size={tp}"


def valid_tp_sizes(constraints: Iterable[Constraint], limit: int = MAX_TP) -> list[int]:
    """All tp sizes in ``1..limit`` that satisfy every constraint."""
    items = list(constraints)
    return [tp for tp in range(1, limit + 1) if all(c.ok(tp) for c in items)]


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
