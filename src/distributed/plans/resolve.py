"""Turn a plan (``{fnmatch pattern: style}``) into per-module assignments."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn

from .._logging import logger
from .registry import get_style
from .styles import ParallelStyle

Plan = Mapping[str, "str | ParallelStyle"]


@dataclass
class ResolvedPlan:
    """The plan actually applied.

    Attributes:
        source: Where the plan came from (``"argument"``, ``"auto: nn.Sequential chains"``...).
        rules: The plan as data: pattern -> style name.
        assignments: Module name -> style, in module-tree order (only sharding styles
            and explicit ``replicate`` rules that matched).
        notes: Decisions worth telling the user (layers kept replicated and why).
    """

    source: str
    rules: dict[str, str]
    assignments: dict[str, ParallelStyle] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    matches: dict[str, list[str]] = field(default_factory=dict)

    def table(self) -> str:
        """The plan as a table: one row per rule with the modules it matched."""
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
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def match_plan(model: nn.Module, plan: Plan, source: str) -> ResolvedPlan:
    """Assign each module the style of the first plan pattern that matches its name.

    Patterns use :mod:`fnmatch` syntax on the full module name (``*`` also
    matches dots, so ``layers.*.mlp.up_proj`` matches ``layers.3.mlp.up_proj``).

    Raises:
        ValueError: a style name is unknown (all rules are checked, matched or not).
        TypeError: the plan is not a mapping of strings to styles.
    """
    if not isinstance(plan, Mapping):
        raise TypeError("plan must be a dict of {module pattern: style}, "
                        f"got {type(plan).__name__}")
    styles = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str):
            raise TypeError(f"plan keys must be module-name patterns (str), got {pattern!r}")
        styles[pattern] = get_style(style, pattern)
    resolved = ResolvedPlan(source, {p: s.name for p, s in styles.items()})
    used: set[str] = set()
    for name, _ in model.named_modules():
        if not name:
            continue
        matched = next((p for p in styles if fnmatch.fnmatchcase(name, p)), None)
        if matched is not None:
            resolved.assignments[name] = styles[matched]
            resolved.matches.setdefault(matched, []).append(name)
            used.add(matched)
    for pattern in styles:
        if pattern not in used:
            logger.warning("torchtp plan rule %r (style %s) matches no module", pattern, styles[pattern].name)
            resolved.notes.append(f"rule {pattern!r} matched no module")
    return resolved
