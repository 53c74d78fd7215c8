"""Choose the plan by cost: the candidate plans, and per lone layer split or replicated.

Without an explicit plan (``plan=None``, ``"auto"`` or ``"auto-memory"``) the
candidates are the model's own HF plan and torchtp's built-in plan for its
architecture (models of a registered family, :mod:`torchtp.plans.sources`), and
the automatic plan (every model; with the experts rules of the first two). Each
is resolved as the wrapper would resolve it (rules matched, attention split by
whole heads, every attention split confirmed by the probe of
:mod:`torchtp.plans.verify`). A candidate that
cannot be planned at this tp (a style that does not fit the module or the tp
size, a tied parameter split two ways) is discarded with the reason, except
the first source (the model's own plan, else the built-in one, else the
automatic plan): its rules then go on unchanged, so the wrapper raises what it
always raised (more ranks than heads) instead of replicating what the model's
authors split. A first source with a style torchtp cannot honour for a module
(``all_reduce``: Inkling's plan) is discarded like the others when another candidate remains, with a note
naming the style and the candidate chosen instead; a plan the user passed with
such a style is refused. An attention split the probe does
not confirm stays replicated, and the candidate competes without it (the
reason is shown). The chooser never replicates a pair's block: splitting them
is what the candidates decide.

**Lone layers.** A module split on its own (a head split and gathered, an
input-split Linear, an embedding split by vocabulary or features) costs its
collectives and saves its weight bytes per rank. By default it stays split
only when the bytes it saves per rank are at least what the link moves in the
time its collectives take per forward + backward, latency included
(``saved >= seconds x bus bandwidth`` on the hardware profile,
:mod:`torchtp.plans.cost`): a 10-class head saves a few KiB and costs
milliseconds of latency (replicated); the 32k-vocabulary LM head of a real
model saves tens of MiB (split).

**The winner** (:data:`MEMORY_SLACK`):

* default, "fastest that fits": among the candidates whose parameter bytes
  per rank are within 5% of the leanest candidate's, the one whose
  collectives take least time;
* ``plan="auto-memory"``: every lone layer split; the leanest candidate;
* ``max_memory_per_rank=N``: each candidate starts with every lone layer
  replicated, then splits them (most bytes saved per second of communication
  first) until it holds at most ``N`` bytes of parameters per rank; the
  fastest candidate that fits wins, and a :class:`ValueError` says how close
  each came when none fits.

Ties go to the source order (HF plan, built-in, automatic). ``describe_plan()``
lists every candidate with its collectives, bytes, estimated time, parameter
bytes per rank and verdict. Nothing here touches a weight or communicates.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from ..core.errors import UnsupportedStyleError
from ..costmodel import Hardware
from .constraints import check
from .cost import (
    PlanCost,
    Shapes,
    is_lone,
    plan_cost,
    shapes_from_trace,
    size_text,
    time_text,
)
from .resolved import ResolvedPlan, Rules
from .styles import Replicate, ShardContext
from .tying import check_ties, tied_groups

MEMORY_SLACK = 0.05  # candidates within 5% of the leanest's parameter bytes per rank fit
FASTEST, MEMORY = "fastest", "memory"


@dataclass
class Candidate:
    """One candidate plan as costed.

    Attributes:
        rules: Its rules as the source gave them.
        order: Its place in the source order (ties go to the lower).
        plan: The plan resolved from them, lone layers decided (``None``: discarded).
        cost: Its cost (``None``: discarded).
        written: Its cost as the source wrote it, before the lone layers were decided.
        verdict: Why it won or lost, for ``describe_plan()``.
        replicated: Lone modules the cost model keeps whole, with why.
        split: Lone modules the cost model keeps split, with why.
        unsupported: It was discarded for a style torchtp cannot honour.
    """

    rules: Rules
    order: int
    plan: ResolvedPlan | None = None
    cost: PlanCost | None = None
    written: PlanCost | None = None
    verdict: str = ""
    unsupported: bool = False  # discarded for a style torchtp cannot honour
    replicated: dict[str, str] = field(default_factory=dict)
    split: dict[str, str] = field(default_factory=dict)


@dataclass
class Choice:
    """The candidates the cost model compared, and the winner.

    Attributes:
        profile: The hardware profile's name.
        rule: The selection rule (default, ``auto-memory``, or the memory budget).
        candidates: Every candidate, in source order, with its cost and verdict.
    """

    profile: str
    rule: str
    candidates: list[Candidate]

    def lines(self) -> list[str]:
        """The comparison as text (``describe_plan()``)."""
        out = [f"plan chosen by cost ({self.profile} profile; {self.rule}); per forward + "
               "backward:"]
        for c in self.candidates:
            if c.cost is None:
                out.append(f"  - {c.rules.source}: {c.verdict}")
                continue
            line = f"  - {c.rules.source}: {_summary(c.cost)}"
            if c.written is not None and c.written != c.cost:
                line += f" (as written: {_summary(c.written)})"
            out.append(f"{line} -> {c.verdict}")
        return out


def _summary(cost: PlanCost) -> str:
    ops = ", ".join(f"{n} x {op}" for op, n in sorted(cost.forward.items())) or "none"
    return (f"{ops} per forward; {size_text(cost.moved)} moved, ~{time_text(cost.seconds)}; "
            f"{size_text(cost.memory)} of parameters per rank")


Resolve = Callable[[Rules], ResolvedPlan]


def choose(model: nn.Module, sources: list[Rules], ctx: ShardContext, resolve: Resolve,
           hw: Hardware, tokens: int, mode: str = FASTEST, budget: int | None = None) -> Rules:
    """The rules of the cheapest candidate, with its lone layers decided (module docstring).

    Args:
        model: The model being planned.
        sources: The candidates' rules, in source order (never empty).
        ctx: The tp size.
        resolve: Resolves rules on ``model`` as the wrapper would, with its options (a
            candidate they cannot use raises: it is discarded).
        hw: The hardware profile.
        tokens: Rows per module when no candidate recorded a probe forward.
        mode: ``"fastest"`` or ``"memory"`` (``plan="auto-memory"``).
        budget: Parameter bytes per rank the plan must fit (``max_memory_per_rank``).

    Returns:
        The winner's rules; the first source's rules unchanged when they cannot
        be planned (the model's own or built-in plan decides the valid tp sizes
        and what must split: the wrapper's checks then raise naming the problem).

    Raises:
        ValueError: a budget no candidate fits.
    """
    trace = next((r.trace for r in sources if r.trace is not None), None)
    shapes = shapes_from_trace(trace, tokens)
    candidates = [Candidate(rules, i) for i, rules in enumerate(sources)]
    for c in candidates:
        _cost(model, c, ctx, resolve, shapes, hw, mode, budget)
    first = candidates[0]
    alive = [c for c in candidates if c.cost is not None]
    if first.cost is None and not (first.unsupported and alive):
        # The model's own (or built-in) plan cannot be planned as written (more ranks
        # than heads, a tied parameter split two ways, a style torchtp cannot honour
        # with no other candidate): the caller's to fix, not a reason to replicate what
        # it splits. Its rules go on as given, to fail the wrapper's checks (after the
        # options' own, as for any plan) or to list the blockers (torchtp plan).
        return first.rules
    winner, rule = _select(alive, mode, budget, ctx)
    choice = Choice(hw.name, rule, candidates)
    rules = _as_rules(winner, choice)
    if first.cost is None:  # a style torchtp cannot honour: another candidate, said
        why = first.verdict.removeprefix("discarded: ")
        rules.notes.insert(0, f"{first.rules.source} not used: {why}; "
                           f"{winner.rules.source} chosen instead")
    return rules


def _cost(model: nn.Module, c: Candidate, ctx: ShardContext, resolve: Resolve, shapes: Shapes,
          hw: Hardware, mode: str, budget: int | None) -> None:
    """Resolve, check and cost one candidate, deciding its lone layers (or discard it)."""
    try:
        plan = resolve(c.rules)
        if plan.problems:
            raise plan.problems[0]
        check(plan.constraints, ctx.world_size, ctx.model_name)
        check_ties(model, plan, ctx)
    except (TypeError, ValueError) as err:
        c.verdict = f"discarded: {err}"
        c.unsupported = isinstance(err, UnsupportedStyleError)
        return
    c.written = plan_cost(model, plan, ctx.world_size, shapes, hw)
    _decide_lone(model, c, plan, ctx, shapes, hw, mode, budget)
    c.plan, c.cost = plan, plan_cost(model, plan, ctx.world_size, shapes, hw)
    kept = [a for a, v in plan.checks.items() if v.startswith("kept replicated")]
    if kept:
        c.verdict = (f"{len(kept)} head split(s) not confirmed by the probe, kept "
                     f"replicated (e.g. '{kept[0]}'); ")
    if c.replicated:
        c.verdict += (f"{len(c.replicated)} layer(s) split alone kept whole by cost (e.g. "
                      f"'{next(iter(c.replicated))}'); ")


def _units(model: nn.Module, plan: ResolvedPlan) -> list[list[str]]:
    """Lone split modules, tied ones together (both split or both whole)."""
    lone = [n for n, s in plan.assignments.items()
            if is_lone(s) and n in plan.layers and plan.layers[n].layouts]
    units: list[list[str]] = []
    grouped: set[str] = set()
    for group in tied_groups(model):
        members = sorted({m for m, _ in group if m in plan.assignments}, key=list(plan.assignments).index)
        if any(m in lone for m in members):
            if all(m in lone for m in members):
                units.append(members)
            grouped.update(members)  # tied to a module split otherwise: left as planned
    units += [[n] for n in lone if n not in grouped]
    return units


def _decide_lone(model: nn.Module, c: Candidate, plan: ResolvedPlan, ctx: ShardContext,
                 shapes: Shapes, hw: Hardware, mode: str, budget: int | None) -> None:
    """Keep each lone unit split or replicate it, as the mode says; record why."""
    units = _units(model, plan)
    if not units:
        return
    tp = ctx.world_size
    split = plan_cost(model, plan, tp, shapes, hw)
    worth: list[tuple[list[str], float, int, float]] = []  # unit, seconds, saved, bytes moved
    for unit in units:
        whole = _replicated(model, plan, unit, ctx)
        alone = plan_cost(model, whole, tp, shapes, hw)
        worth.append((unit, split.seconds - alone.seconds, alone.memory - split.memory,
                      split.moved - alone.moved))
    if mode == MEMORY:
        for unit, seconds, saved, _ in worth:
            for name in unit:
                c.split[name] = (f"plan='auto-memory': split (saves {size_text(saved)} per rank; "
                                 f"~{time_text(seconds)} of collectives per step)")
        return
    if budget is None:
        keep = {id(u) for u, seconds, saved, _ in worth if saved >= seconds * hw.bus_bandwidth}
    else:
        keep = set()
        memory = plan_cost(model, _replicated(model, plan, [n for u in units for n in u], ctx),
                           tp, shapes, hw).memory
        for unit, _, saved, _ in sorted(worth, key=lambda w: -w[2] / max(w[1], 1e-12)):
            if memory <= budget:
                break
            keep.add(id(unit))
            memory -= saved
    for unit, seconds, saved, moved in worth:
        what = (f"saves {size_text(saved)} of parameters per rank; its collectives move "
                f"{size_text(moved)} and take ~{time_text(seconds)} per forward + backward "
                f"on {hw.name}, worth {size_text(seconds * hw.bus_bandwidth)} at the link's "
                "bandwidth")
        for name in unit:
            if id(unit) in keep:
                c.split[name] = (f"cost: split; it {what}" if budget is None else
                                 f"cost: split to fit max_memory_per_rank; it {what}")
            else:
                c.replicated[name] = (f"cost: kept replicated: splitting it alone {what}" if
                                      budget is None else "cost: kept replicated: fits "
                                      f"max_memory_per_rank without splitting it; it {what}")
    gone = [n for u in units if id(u) not in keep for n in u]
    if gone:
        whole = _replicated(model, plan, gone, ctx)
        plan.assignments, plan.layers = whole.assignments, whole.layers
        for name in gone:
            plan.why[name] = c.replicated[name]


def _replicated(model: nn.Module, plan: ResolvedPlan, names: list[str],
                ctx: ShardContext) -> ResolvedPlan:
    """A copy of ``plan`` (assignments and layers only) with ``names`` kept whole."""
    assignments, layers = dict(plan.assignments), dict(plan.layers)
    for name in names:
        assignments[name] = Replicate()
        layers[name] = Replicate().plan(model.get_submodule(name), name, ctx)
    return ResolvedPlan(plan.source, plan.rules, assignments, layers=layers)


def _select(alive: list[Candidate], mode: str, budget: int | None,
            ctx: ShardContext) -> tuple[Candidate, str]:
    """The winner and the rule it won by; every candidate gets its verdict."""
    costs = {id(c): _costed(c) for c in alive}
    lean = min(alive, key=lambda c: costs[id(c)].memory)
    if mode == MEMORY:
        rule = "plan='auto-memory': the least parameter bytes per rank, then the fastest"
        fit = alive
    elif budget is not None:
        rule = f"the fastest that fits max_memory_per_rank={budget} bytes of parameters"
        fit = [c for c in alive if costs[id(c)].memory <= budget]
        if not fit:
            least = costs[id(lean)].memory
            raise ValueError(
                f"{ctx.model_name}: no plan fits max_memory_per_rank={budget} bytes "
                f"({size_text(budget)}) at world_size={ctx.world_size}: the leanest, "
                f"{lean.rules.source}, holds {least} bytes ({size_text(least)}) of parameters "
                "per rank, every layer it splits alone split too; raise the budget, use more "
                "ranks, or pass plan= to split more")
    else:
        limit = costs[id(lean)].memory * (1 + MEMORY_SLACK)
        rule = (f"fastest that fits: the least time among candidates within "
                f"{MEMORY_SLACK:.0%} of the leanest's parameter bytes per rank")
        fit = [c for c in alive if costs[id(c)].memory <= limit]
    if mode == MEMORY:
        winner = min(fit, key=lambda c: (costs[id(c)].memory, costs[id(c)].seconds, c.order))
    else:
        winner = min(fit, key=lambda c: (costs[id(c)].seconds, costs[id(c)].memory, c.order))
    for c in alive:
        c.verdict += _verdict(costs[id(c)], costs[id(winner)], c is winner, c in fit, mode,
                              len(alive))
    return winner, rule


def _costed(c: Candidate) -> PlanCost:
    assert c.cost is not None
    return c.cost


def _verdict(mine: PlanCost, best: PlanCost, won: bool, fits: bool, mode: str,
             alive: int) -> str:
    if won:
        return "chosen" if alive > 1 else "chosen (the only candidate)"
    if not fits:
        return (f"does not fit: {size_text(mine.memory)} per rank against "
                f"{size_text(best.memory)}")
    if mode == MEMORY and mine.memory > best.memory:
        return f"holds more: {size_text(mine.memory)} per rank"
    if mine.seconds > best.seconds:
        return f"slower: ~{time_text(mine.seconds)} against ~{time_text(best.seconds)}"
    return "as cheap; the winner comes first in the source order"


def _as_rules(winner: Candidate, choice: Choice) -> Rules:
    """The winner's rules with its replicated lone modules written in, and the choice."""
    rules, plan = winner.rules, winner.plan
    assert plan is not None
    styles = dict(rules.rules)
    why = dict(rules.why)
    names = set(winner.replicated)
    overrides: dict[str, str] = {}
    for pattern, matched in plan.matches.items():
        hit = [n for n in matched if n in names]
        if not hit:
            continue
        if len(hit) == len(matched):  # every module of the rule stays whole
            styles[pattern] = "replicate"
            why[pattern] = winner.replicated[hit[0]]
        else:
            for name in hit:
                overrides[name] = "replicate"
                why[name] = winner.replicated[name]
    for name in sorted(names - {n for m in plan.matches.values() for n in m}):
        overrides[name] = "replicate"  # not from a rule (none expected): named exactly
        why[name] = winner.replicated[name]
    for name, text in winner.split.items():
        found = next((p for p in styles if fnmatch.fnmatchcase(name, p)), None)
        if found is not None and text not in why.get(found, ""):
            why[found] = f"{why.get(found, f'rule {found!r}')}; {text}"
    # The automatic plan's proposal to split them alone no longer holds.
    notes = [n for n in rules.notes
             if not any(n.startswith(f"'{x}' has no partner Linear") for x in names)]
    notes += [f"'{n}' {winner.replicated[n].removeprefix('cost: ')}" for n in sorted(names)]
    return Rules(rules.source, {**overrides, **styles}, notes, why, rules.heads, rules.trace,
                 choice)
