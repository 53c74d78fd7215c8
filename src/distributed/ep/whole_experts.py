"""Expert parallelism for hand-written MoEs: each expert of an ``nn.ModuleList`` on a block of ranks.

The automatic plan sums a hand-written MoE's experts once
(:mod:`torchtp.plans.late_reduce`): every expert's ``down`` is
``rowwise_partial``, fed by its ``up``/``gate`` projections (``colwise``),
each split over the whole TP group. With ``expert_parallel=k`` the TP group's
``tp`` ranks form ``k`` consecutive blocks of ``t = tp / k`` ranks, the experts
of each list are shared out over the blocks by the one split rule
(:func:`torchtp.core.layouts.shard_range` of the expert count), and an
expert's Linears are split over its block only: its ``up`` weight rows
(``out_features``), its ``down`` weight columns (``in_features``), exactly as
the plain split but over ``t`` ranks. The other ranks hold none of its rows or
columns (layouts with no segment: ``(0, in)`` / ``(out, 0)`` tensors), so
their ``up`` returns ``(..., 0)`` and their ``down`` an exact zero partial sum:
the same parallel layers, the same collectives on every rank.
``expert_parallel=True`` is ``k = tp`` (whole experts, ``t = 1``). The
reduction point, the router's gradient sum and any part outside a list (a
shared expert) stay as the automatic plan made them.
"""

from __future__ import annotations

from torch import nn

from ..core.layouts import shard_range
from ..plans.auto import common_owner
from ..plans.constraints import Constraint
from ..plans.linear_view import LinearView
from ..plans.resolved import ResolvedPlan
from ..plans.styles import Colwise, ShardContext
from ..plans.styles_partial import RowwisePartial


class ExpertBlock:
    """Where expert ``index`` of ``count`` lives: a block of ``tp / ep`` consecutive ranks."""

    def __init__(self, index: int, count: int, ep: int) -> None:
        self.index, self.count, self.ep = index, count, ep

    def ranks(self, world_size: int) -> range:
        """The ranks of this expert's block."""
        per = world_size // self.ep
        block = next(b for b in range(self.ep)
                     if _holds(shard_range(self.count, self.ep, b), self.index))
        return range(block * per, (block + 1) * per)

    def share(self, size: int, ctx: ShardContext) -> tuple[tuple[int, int], ...]:
        """This rank's range of ``size`` features: its block share, or none."""
        ranks = self.ranks(ctx.world_size)
        if ctx.rank not in ranks:
            return ()
        return (shard_range(size, len(ranks), ctx.rank - ranks.start),)

    def detail(self) -> str:
        """For ``describe_plan()``."""
        return f"expert {self.index} of {self.count} over {self.ep} blocks of ranks"


class ExpertRows(Colwise):
    """An expert's first projection: weight rows over its block (``colwise`` there)."""

    def __init__(self, block: ExpertBlock) -> None:
        super().__init__()
        self.name, self.block = "ep_expert_rows", block

    def constraints(self, view: LinearView, fqn: str) -> list[Constraint]:
        return []  # a rank may hold none of the list's experts

    def row_segments(self, view: LinearView, ctx: ShardContext) -> tuple[tuple[int, int], ...]:
        return self.block.share(view.out_features, ctx)

    def detail(self, view: LinearView) -> str:
        return self.block.detail()


class ExpertColumns(RowwisePartial):
    """An expert's last projection: weight columns over its block, a partial sum everywhere.

    Its bias stays replicated and is added on rank 0 (every rank runs every
    expert that gets tokens: the routing is replicated), so the sum adds it once.
    """

    def __init__(self, block: ExpertBlock, producers: tuple[str, ...]) -> None:
        super().__init__(producers)
        self.name, self.block = "ep_expert_columns", block

    def constraints(self, view: LinearView, fqn: str) -> list[Constraint]:
        return []

    def column_segments(self, view: LinearView, ctx: ShardContext
                        ) -> tuple[tuple[int, int], ...]:
        return self.block.share(view.in_features, ctx)

    def detail(self, view: LinearView) -> str:
        return self.block.detail()


def _holds(share: tuple[int, int], index: int) -> bool:
    start, length = share
    return start <= index < start + length


def place_experts(model: nn.Module, plan: ResolvedPlan, ep: int) -> dict[str, list[str]]:
    """Put each hand-written expert (a ``rowwise_partial`` Linear and its producers whose
    expert is an element of an ``nn.ModuleList``) on its block of ranks; per list, its experts.
    """
    lists: dict[str, list[tuple[int, str, tuple[str, ...]]]] = {}
    for name, style in plan.assignments.items():
        if not (isinstance(style, RowwisePartial) and style.producers):
            continue
        unit = common_owner([name, *style.producers]) or ""
        parent, _, index = unit.rpartition(".")
        # Plain row splits only: a fused gate|up (stacked halves) keeps its own split.
        plain = all(type(plan.assignments.get(p)) is Colwise for p in style.producers)
        if plain and index.isdigit() and isinstance(_get(model, parent), nn.ModuleList):
            lists.setdefault(parent, []).append((int(index), name, style.producers))
    for experts in lists.values():
        experts.sort()
        for i, (_, down, producers) in enumerate(experts):
            block = ExpertBlock(i, len(experts), ep)
            plan.assignments[down] = ExpertColumns(block, producers)
            for up in producers:
                plan.assignments[up] = ExpertRows(block)
    return {parent: [f"{parent}.{i}" for i, _, _ in experts] for parent, experts in lists.items()}


def _get(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name) if name else model
    except AttributeError:
        return None
