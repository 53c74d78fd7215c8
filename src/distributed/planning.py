"""Decide what to split: resolve the plan, check it, and describe it.

Resolution order: the ``plan`` argument (a dict, a YAML/JSON file, or
``"builtin"`` for torchtp's own plan of the architecture); else,
for HuggingFace models, the model's own plan, then torchtp's built-in plan
for its architecture, then structural detection; else (plain models) the
automatic ``nn.Sequential`` chain plan.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast, overload

from torch import nn

from ._logging import logger
from .hf import adjust_attention_modules, head_aware_assignments, hf_plan, is_hf_model
from .hf.attention import HeadInfo
from .hf.builtin import BUILTIN_PLANS, builtin_plan
from .hf.structural import structural_plan
from .plans import (
    Constraint,
    ResolvedPlan,
    ShardContext,
    check,
    load_plan_file,
    match_plan,
    sequential_plan,
    valid_tp_sizes,
)
from .tying import check_ties

PlanArg = Mapping[str, Any] | str | os.PathLike[str] | None


@dataclass
class Planned:
    """A checked plan, ready to apply.

    Attributes:
        plan: The resolved plan (source, rules, per-module styles, notes).
        heads: Attention modules whose heads are split, with their geometry.
        constraints: What the plan needs of the tp size.
    """

    plan: ResolvedPlan
    heads: dict[str, HeadInfo] = field(default_factory=dict)
    constraints: list[Constraint] = field(default_factory=list)

    @property
    def valid_world_sizes(self) -> list[int]:
        """Every tp size (up to 64) this model and plan accept."""
        return valid_tp_sizes(self.constraints)


def resolve(model: nn.Module, plan: PlanArg, ctx: ShardContext) -> ResolvedPlan:
    """Pick the plan for ``model`` following the resolution order."""
    if plan == "builtin":
        return _builtin(model, required=True)
    if isinstance(plan, (str, os.PathLike)):
        return match_plan(model, load_plan_file(plan), f"file {os.fspath(plan)}")
    if plan is not None:
        return match_plan(model, plan, "argument")
    if not is_hf_model(model):
        return sequential_plan(model, ctx.world_size)
    own = hf_plan(model)
    if own:
        return match_plan(model, own, "HF plan (config.base_model_tp_plan + _tp_plan)")
    return _builtin(model, required=False) or structural_plan(model)


@overload
def _builtin(model: nn.Module, required: Literal[True]) -> ResolvedPlan: ...
@overload
def _builtin(model: nn.Module, required: Literal[False]) -> ResolvedPlan | None: ...


def _builtin(model: nn.Module, required: bool) -> ResolvedPlan | None:
    """torchtp's plan for the model's architecture (``plan="builtin"`` forces it)."""
    if not is_hf_model(model):
        if required:
            raise ValueError("plan='builtin' needs a HuggingFace model; pass a dict plan")
        return None
    prefix = cast(str, model.base_model_prefix) if model.base_model is not model else ""
    model_type = getattr(model.config, "model_type", "")
    rules = builtin_plan(model_type, prefix)
    if rules is None:
        if required:
            raise ValueError(f"plan='builtin': torchtp has no built-in plan for "
                             f"model_type={model_type!r}; built-in plans exist for "
                             f"{sorted(BUILTIN_PLANS)}")
        return None
    return match_plan(model, rules, f"torchtp built-in plan for {model_type!r}")


def prepare(model: nn.Module, plan: PlanArg, ctx: ShardContext) -> Planned:
    """Resolve and check the plan without touching any weight or communicating.

    Raises:
        TypeError: a style does not fit its module's type.
        ValueError: unknown style, unsupported style, a dimension that does not
            split at ``ctx.world_size`` (listing the valid sizes), or a tied
            parameter split two ways.
    """
    resolved = resolve(model, plan, ctx)
    modules = dict(model.named_modules())
    heads = head_aware_assignments(model, resolved)
    for name, style in resolved.assignments.items():
        style.check_type(modules[name], name)
    constraints = [c for name, style in resolved.assignments.items()
                   for c in style.constraints(modules[name], name)]
    check(constraints, ctx.world_size, ctx.model_name)
    check_ties(model, resolved, ctx)
    for note in resolved.notes:
        logger.info("torchtp: %s", note)
    return Planned(resolved, heads, constraints)


def finish(model: nn.Module, planned: Planned, ctx: ShardContext) -> None:
    """Post-swap fixes: local head counts in attention modules."""
    adjust_attention_modules(model, planned.heads, ctx)
