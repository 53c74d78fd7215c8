"""The tensor-parallel dimension's steps in the wrapper's pipeline.

The pipeline is resolve → agree → apply → hooks; each parallel dimension
contributes its own place (where its shards go), plan and apply step from its
own module, so the next dimension (``ep``, ``pp``) is one more module, not a
branch inside the wrapper. For ``tp``: :func:`place` answers which group,
size and rank; :func:`resolve` resolves the plan (``torchtp.plans``);
:func:`apply` swaps the planned modules for their parallel layers and installs
the plan's options (loss and sequence parallelism).

May import: runtime, layers, plans, options.
"""

from __future__ import annotations

from torch import nn

from ..comm.runtime import ProcessGroup
from ..layers._base import resolve_placement
from ..plans import ResolvedPlan, ShardContext, apply_plan, resolve_plan
from ..plans.resolve import PlanArg
from ..training.options import Options


def place(model: nn.Module, world_size: int | None, rank: int | None,
          group: ProcessGroup | None) -> ShardContext:
    """Where the TP shards go: the group, its size and this rank (checked against the group).

    Raises:
        ValueError: ``world_size``/``rank`` contradict the group.
    """
    g, size, me = resolve_placement("DistributedModelWrapper", world_size, rank, group)
    return ShardContext(size, me, g, type(model).__name__)


def resolve(model: nn.Module, plan: PlanArg, ctx: ShardContext, options: Options,
            example_inputs: object, verify: bool, budget: int | None = None) -> ResolvedPlan:
    """The plan every module follows at this tp (rank-local; agreed on next)."""
    return resolve_plan(model, plan, ctx, example_inputs=example_inputs,
                        adjust=options.adjust, verify=verify, max_memory=budget)


def apply(model: nn.Module, plan: ResolvedPlan, ctx: ShardContext, options: Options) -> list[str]:
    """Cut every planned module to this rank's shard and install the options' hooks.

    Returns:
        The names of the swapped layers, in module order.
    """
    names = apply_plan(model, plan, ctx)
    options.install(model, ctx)
    return names
