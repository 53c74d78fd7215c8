"""Decide what to split: the one planning pipeline (see docs/concepts.md, "Follow a wrap").

:func:`resolve_plan` runs four steps, each visible in ``describe_plan()``:

1. pick the rules: the ``plan`` argument (a dict, a YAML/JSON file, or
   ``"builtin"``) as given; else the candidate chosen by cost
   (:mod:`torchtp.plans.choose`) among, for a model of a registered family
   (:mod:`torchtp.plans.sources`; HuggingFace models, registered by
   ``torchtp.hf``), the model's own plan and torchtp's built-in plan for its
   architecture, and, for every model, the automatic plan, which pairs
   Linears by the dataflow of one probe forward and splits attention by whole
   heads (:mod:`torchtp.plans.auto`); lone split layers of the winner stay
   split only where that pays;
2. match the rules' ``fnmatch`` patterns against module names;
3. upgrade sharded attention projections to whole-head splits, the output
   projection's input columns included wherever it lives, and confirm each
   on the real module with the automatic plan's probe
   (:mod:`torchtp.plans.verify`; the automatic plan confirms its own);
4. plan every layer once (:meth:`~torchtp.plans.styles.ParallelStyle.plan`) and
   check the constraints on the tp size, tied parameters, and that every
   output projection cuts the same heads as its q/k/v projections.

Nothing here touches a weight or communicates.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from torch import nn

from ..core.log import logger
from .auto import auto_plan, probe_tokens
from .choose import FASTEST, MEMORY, choose
from .constraints import check
from .cost import hardware_for, memory_per_rank, size_text
from .files import load_plan_file
from .head_boundaries import check_head_boundaries
from .head_split import split_whole_heads
from .registry import EXPERT_STYLES, get_style
from .resolved import Plan, ResolvedPlan, Rules
from .sources import family_of, inner_model
from .state_space import split_mixers
from .styles import ParallelStyle, ShardContext
from .styles_state_space import SsmHeads
from .tying import check_ties
from .verify import verify_heads

PlanArg = Mapping[str, Any] | str | os.PathLike[str] | None
# Edits the matched plan before its layers are planned (the wrapper's
# loss_parallel / sequence_parallel options).
PlanAdjust = Callable[[nn.Module, ResolvedPlan, ShardContext], None]
AUTO = ("auto", "auto-memory")  # the default resolution; "-memory" lets the cost guard pass


def resolve_plan(model: nn.Module, plan: PlanArg, ctx: ShardContext, strict: bool = True,
                 example_inputs: object = None,
                 adjust: PlanAdjust | None = None, verify: bool = True,
                 max_memory: int | None = None) -> ResolvedPlan:
    """Pick the plan's source, match it, split heads whole, and plan every layer.

    Args:
        model: The model to plan (may live on the meta device).
        plan: As for :class:`~torchtp.DistributedModelWrapper`.
        ctx: The tp size and this rank.
        strict: Raise the first problem; with ``False`` problems are collected in
            ``problems`` and constraints are left unchecked (``torchtp plan``
            lists every blocker).
        example_inputs: Inputs for the automatic plan's probe forward (see
            :func:`~torchtp.plans.auto.auto_plan`).
        adjust: Called with the matched plan after the head splits, before the
            layers are planned (may change assignments).
        verify: ``False`` skips the probe of whole-head attention splits
            (``verify_plan=False``: exactness is then the user's responsibility).
        max_memory: Parameter bytes per rank the plan must fit
            (``max_memory_per_rank``); ``None``: no limit.

    Raises:
        TypeError: a style does not fit its module's type.
        ValueError: unknown style, unsupported style, a dimension that does not
            split at ``ctx.world_size`` (listing the valid sizes), a tied
            parameter split two ways, a user plan's attention split that the
            probe does not confirm, or a plan that does not fit ``max_memory``.
    """
    rules = pick_rules(model, plan, ctx, example_inputs, verify=verify, max_memory=max_memory,
                       adjust=adjust)
    resolved = _matched(model, rules, ctx, example_inputs, verify)
    if adjust is not None:
        adjust(model, resolved, ctx)
    _plan_layers(model, resolved, ctx)
    if strict:
        if resolved.problems:
            raise resolved.problems[0]
        check(resolved.constraints, ctx.world_size, ctx.model_name)
        check_ties(model, resolved, ctx)
        if max_memory is not None:
            _check_memory(model, resolved, ctx, max_memory)
        for note in resolved.notes:
            logger.info("torchtp: %s", note)
    return resolved


def _matched(model: nn.Module, rules: Rules, ctx: ShardContext, example_inputs: object,
             verify: bool) -> ResolvedPlan:
    """Steps 2 and 3: the rules matched, attention split by whole heads and verified."""
    resolved = match_rules(model, rules)
    if rules.heads is not None:  # the automatic plan: confirmed by its own probe
        resolved.heads = dict(rules.heads)
    else:
        resolved.heads = split_whole_heads(model, resolved)
        if resolved.heads:  # attention split by whole heads: each split verified
            resolved.problems += verify_heads(model, resolved, ctx, example_inputs, verify)
    if any(isinstance(s, SsmHeads) for s in resolved.assignments.values()):
        resolved.problems += split_mixers(model, resolved, ctx, verify)
    return resolved


def _plan_layers(model: nn.Module, resolved: ResolvedPlan, ctx: ShardContext) -> None:
    """Step 4: every layer planned once; problems collected, head boundaries checked."""
    modules = dict(model.named_modules())
    for name, style in resolved.assignments.items():
        try:
            resolved.layers[name] = style.plan(modules[name], name, ctx)
        except (TypeError, ValueError) as err:
            resolved.problems.append(err)
    if resolved.heads:  # every rank reaches the same verdict from the plan alone
        try:
            check_head_boundaries(resolved.heads, resolved.assignments, modules, ctx)
        except ValueError as err:  # first: it names the boundaries, the probe only a shape
            resolved.problems.insert(0, err)


def _check_memory(model: nn.Module, resolved: ResolvedPlan, ctx: ShardContext,
                  budget: int) -> None:
    """Raise if the plan leaves more than ``budget`` parameter bytes on a rank."""
    held = memory_per_rank(model, resolved, ctx.world_size)
    if held > budget:
        raise ValueError(
            f"{ctx.model_name}: the plan ({resolved.source}) holds {held} bytes "
            f"({size_text(held)}) of parameters per rank at world_size={ctx.world_size}, more "
            f"than max_memory_per_rank={budget} ({size_text(budget)}); split more layers in "
            "the plan, use more ranks, or leave plan=None to let the cost model choose")


def pick_rules(model: nn.Module, plan: PlanArg, ctx: ShardContext,
               example_inputs: object = None, *, verify: bool = True,
               max_memory: int | None = None, adjust: PlanAdjust | None = None) -> Rules:
    """The rules for ``model``: the explicit plan, else the candidate chosen by cost
    among those ``adjust`` (the wrapper's options) accepts.

    Raises:
        ValueError: as :func:`torchtp.plans.choose.choose`.
    """
    memory = plan == "auto-memory"
    if plan in AUTO:
        plan = None
    if plan == "builtin":
        return _builtin(model)
    if isinstance(plan, (str, os.PathLike)):
        return Rules(f"file {os.fspath(plan)}", load_plan_file(plan))
    if plan is not None:
        return Rules("argument", plan)
    family = family_of(model)
    if family is None:
        inner = inner_model(model)
        if inner is not None:
            return _inside(*inner, ctx, memory, verify, max_memory)
        sources = [auto_plan(model, ctx, example_inputs, memory)]
        probe = example_inputs
    else:
        probe = family.probe_inputs(model) if example_inputs is None else example_inputs
        sources = [r for r in (family.own_rules(model), family.builtin_rules(model)) if r]
        try:
            sources.append(_with_experts(
                auto_plan(model, ctx, probe, memory, family.head_config(model)), sources))
        except Exception as err:  # a model the automatic plan cannot handle: not a candidate
            if not sources:
                raise
            logger.info("torchtp: the automatic plan is not a candidate for %s (%s: %s)",
                        ctx.model_name, type(err).__name__, err)

    def resolve(rules: Rules) -> ResolvedPlan:
        resolved = _matched(model, rules, ctx, example_inputs, verify)
        if adjust is not None:  # a candidate the options cannot use (sequence parallelism
            adjust(model, resolved, ctx)  # on a late reduce) raises: it is discarded
        _plan_layers(model, resolved, ctx)
        return resolved

    return choose(model, sources, ctx, resolve, hardware_for(model, ctx.group),
                  probe_tokens(probe), MEMORY if memory else FASTEST, max_memory)


def _with_experts(auto: Rules, sources: list[Rules]) -> Rules:
    """The automatic plan with the experts rules of the model's own or built-in plan.

    The automatic plan splits Linears and attention by tracing them; an experts
    module's 3-D parameters are split only by the experts styles a plan names. Without
    the rules it would keep every expert whole on every rank, and lose by memory to a
    plan that splits the experts but keeps, say, the attention whole (GPT-OSS's).
    """
    experts: dict[str, str | ParallelStyle] = {}
    for rules in sources:
        for pattern, style in rules.rules.items():
            if style in EXPERT_STYLES and pattern not in auto.rules:
                experts.setdefault(pattern, style)
                auto.why.setdefault(pattern, f"experts rule of the {rules.source}")
    return replace(auto, rules={**auto.rules, **experts}) if experts else auto


def _inside(prefix: str, inner: nn.Module, ctx: ShardContext, memory: bool, verify: bool,
            max_memory: int | None) -> Rules:
    """The rules of the model inside a host (a PEFT model), under the host's module names."""
    own = pick_rules(inner, "auto-memory" if memory else None, ctx, verify=verify,
                     max_memory=max_memory)
    return Rules(f"{own.source}, under '{prefix}'",
                 {f"{prefix}.{pattern}": style for pattern, style in own.rules.items()},
                 list(own.notes), {f"{prefix}.{k}": why for k, why in own.why.items()},
                 None if own.heads is None else {f"{prefix}.{k}": v for k, v in own.heads.items()},
                 choice=own.choice)


def _builtin(model: nn.Module) -> Rules:
    """torchtp's plan for the model's architecture (``plan="builtin"``).

    Raises:
        ValueError: the model belongs to no family, or its family has no
            built-in plan for it.
    """
    family = family_of(model)
    if family is None:
        raise ValueError("plan='builtin' needs a HuggingFace model; pass a dict plan")
    rules = family.builtin_rules(model)
    if rules is None:
        raise family.no_builtin(model)
    return rules


def match_rules(model: nn.Module, rules: Rules) -> ResolvedPlan:
    """Assign each module the style of the first pattern that matches its name.

    Patterns use :mod:`fnmatch` syntax on the full module name (``*`` also
    matches dots, so ``layers.*.mlp.up_proj`` matches ``layers.3.mlp.up_proj``).

    Raises:
        ValueError: a style name is unknown (all rules are checked, matched or not).
        TypeError: the plan is not a mapping of strings to styles.
    """
    plan: Plan = rules.rules
    if not isinstance(plan, Mapping):
        raise TypeError("plan must be a dict of {module pattern: style}, "
                        f"got {type(plan).__name__}")
    styles = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str):
            raise TypeError(f"plan keys must be module-name patterns (str), got {pattern!r}")
        styles[pattern] = get_style(style, pattern)
    resolved = ResolvedPlan(rules.source, {p: s.name for p, s in styles.items()},
                            notes=list(rules.notes), choice=rules.choice)
    for name, _ in model.named_modules():
        if not name:
            continue
        matched = next((p for p in styles if fnmatch.fnmatchcase(name, p)), None)
        if matched is not None:
            resolved.assignments[name] = styles[matched]
            resolved.matches.setdefault(matched, []).append(name)
            resolved.why[name] = rules.why.get(matched, f"rule {matched!r}")
    for pattern in styles:
        if pattern in resolved.matches:
            continue
        owner = _covered_by(pattern, styles)
        if owner is not None:  # a parameter its module's style plans (moe_tp_experts)
            resolved.notes.append(f"rule {pattern!r} ({styles[pattern].name}) is planned by "
                                  f"{owner!r} ({styles[owner].name})")
        else:
            logger.warning("torchtp plan rule %r (style %s) matches no module", pattern,
                           styles[pattern].name)
            resolved.notes.append(f"rule {pattern!r} matched no module")
    return resolved


def _covered_by(pattern: str, styles: Mapping[str, ParallelStyle]) -> str | None:
    """The rule whose style plans the parameter ``pattern`` names, if one does."""
    parent, _, leaf = pattern.rpartition(".")
    style = styles.get(parent)
    return parent if style is not None and any(fnmatch.fnmatchcase(leaf, c)
                                               for c in style.covers) else None
