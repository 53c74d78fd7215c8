"""The result of planning: rules from one source, and the plan resolved from them."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from .constraints import Constraint, valid_tp_sizes
from .styles import LayerPlan, ParallelStyle

if TYPE_CHECKING:
    from .dataflow import Trace
    from .heads import HeadInfo

Plan = Mapping[str, "str | ParallelStyle"]


def is_user_plan(source: str) -> bool:
    """Whether the rules came from the ``plan`` argument (a dict or a file)."""
    return source == "argument" or source.startswith("file ")


class Choice(Protocol):
    """How a plan was chosen by cost (:class:`torchtp.plans.choose.Choice`)."""

    def lines(self) -> list[str]:
        """The comparison as text, for ``describe_plan()``."""


@dataclass
class Rules:
    """A plan as one source gives it, before it is matched against the model.

    Attributes:
        source: Where the rules come from (``"argument"``, ``"HF plan ..."``...).
        rules: ``{fnmatch pattern: style}``.
        notes: What the source decided not to split, and why.
        why: Per rule, why the source chose it (default: the rule itself).
        heads: Attention modules whose heads the source already split whole
            (``None``: the pipeline upgrades q/k/v styles itself).
        trace: The probe forward the source recorded (the automatic plan's), if any.
        choice: How the plan was chosen among candidates by cost (``None``: it was given).
    """

    source: str
    rules: Plan
    notes: list[str] = field(default_factory=list)
    why: dict[str, str] = field(default_factory=dict)
    heads: dict[str, HeadInfo] | None = None
    trace: Trace | None = None
    choice: Choice | None = None


@dataclass
class ResolvedPlan:
    """The plan actually applied.

    Attributes:
        source: Where the plan came from (``"argument"``, ``"HF plan ..."``...).
        rules: The plan as data: pattern -> style name.
        assignments: Module name -> final style, in module-tree order (only
            sharding styles and explicit ``replicate`` rules that matched).
        notes: Decisions worth telling the user (layers kept replicated and why).
        matches: Pattern -> the modules it matched.
        why: Module name -> why it got its final style (the rule, and any
            upgrade such as a whole-head split).
        layers: Module name -> its :class:`~torchtp.plans.styles.LayerPlan`.
        heads: Attention modules whose heads are split, with their geometry.
        problems: Errors found while planning the layers (raised by the wrapper;
            listed by ``torchtp plan``).
        checks: Attention module -> the verdict of the local probe on its whole-head
            split (``"confirmed"``, ``"kept replicated: ..."``, ``"refused: ..."``,
            ``"not verified ..."``; see :mod:`torchtp.plans.verify`).
        choice: The candidates the cost model compared and why this one won
            (``None`` for a plan passed explicitly; see :mod:`torchtp.plans.choose`).
    """

    source: str
    rules: dict[str, str]
    assignments: dict[str, ParallelStyle] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    matches: dict[str, list[str]] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)
    layers: dict[str, LayerPlan] = field(default_factory=dict)
    heads: dict[str, HeadInfo] = field(default_factory=dict)
    problems: list[Exception] = field(default_factory=list)
    checks: dict[str, str] = field(default_factory=dict)
    choice: Choice | None = None

    @property
    def constraints(self) -> list[Constraint]:
        """Every layer's constraints on the tp size."""
        return [c for layer in self.layers.values() for c in layer.constraints]

    @property
    def valid_world_sizes(self) -> list[int]:
        """Every tp size (up to 64) this model and plan accept."""
        return valid_tp_sizes(self.constraints)

    def collectives(self) -> dict[str, int]:
        """Collectives per forward, counting each planned module once."""
        return dict(Counter(op for layer in self.layers.values() for op in layer.collectives))

    def table(self) -> str:
        """The plan as text: rules, every module's final style and why, collectives, notes."""
        rows = [(rule, style, self.matches.get(rule, [rule] if rule in self.assignments else []))
                for rule, style in self.rules.items()]
        width = max([len(r) for r, _, _ in rows] + [4])
        swidth = max([len(s) for _, s, _ in rows] + [5])
        lines = [f"plan source: {self.source}",
                 f"{'rule':<{width}}  {'style':<{swidth}}  modules"]
        for rule, style, names in rows:
            shown = names[0] if len(names) == 1 else f"{len(names)} (e.g. {names[0]})" if names \
                else "none"
            lines.append(f"{rule:<{width}}  {style:<{swidth}}  {shown}")
        lines += self._final_styles()
        ops = self.collectives()
        lines.append("collectives per forward: " + (", ".join(
            f"{n} x {op}" for op, n in sorted(ops.items())) or "none"))
        if self.choice is not None:
            lines += self.choice.lines()
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _final_styles(self) -> list[str]:
        """One row per group of modules (layer numbers as ``*``): style, weight shapes, why."""
        groups: dict[tuple[str, ...], int] = {}
        for name, layer in self.layers.items():
            full = "x".join(map(str, layer.full))
            local = "x".join(map(str, layer.local)) if layer.layouts else "whole"
            why = "; ".join(x for x in (self.why.get(name, ""), layer.detail) if x)
            key = (_stars(name), layer.style, f"{full} -> {local}", _stars(why))
            groups[key] = groups.get(key, 0) + 1
        if not groups:
            return []
        rows = [(f"{k[0]} (x{n})" if n > 1 else k[0], *k[1:]) for k, n in groups.items()]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        out = ["final style of every planned module (weight: full -> this rank's):"]
        out += ["  " + "  ".join(f"{c:<{w}}" for c, w in zip(r[:3], widths, strict=True))
                + f"  {r[3]}" for r in rows]
        return out


def _stars(text: str) -> str:
    """Layer numbers inside module names as ``*`` (``layers.3.mlp`` -> ``layers.*.mlp``)."""
    return re.sub(r"\.\d+\.", ".*.", text)
