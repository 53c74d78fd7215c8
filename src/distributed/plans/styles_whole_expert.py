"""Expert parallelism for hand-written MoEs: each expert of an ``nn.ModuleList`` on one rank.

The automatic plan sums a hand-written MoE's experts once
(:mod:`torchtp.plans.late_reduce`): every expert's ``down`` is
``rowwise_partial`` (features split), fed by its ``up``/``gate`` projections
(``colwise``). With ``expert_parallel=True`` the experts of each
``nn.ModuleList`` are instead shared out over the TP group by the one split
rule (:func:`torchtp.core.layouts.shard_range` of the expert count): each
expert's Linears become :class:`~torchtp.layers.expert_linear.ExpertLinear`,
whole on its rank and an exact zero elsewhere. The reduction point, the
router's gradient sum and any part outside a ``ModuleList`` (a shared expert)
stay as the automatic plan made them: every part still contributes a partial
sum, so the one all-reduce is exact.
"""

from __future__ import annotations

from torch import nn

from ..core.layouts import ParamLayout, shard_range
from ..layers.expert_linear import ExpertLinear
from .constraints import Constraint
from .linear_view import LinearView
from .resolved import ResolvedPlan
from .styles import LayerPlan, LinearStyle, ShardContext, _shards
from .styles_partial import RowwisePartial


class WholeExpert(LinearStyle):
    """One Linear of expert ``index`` of ``count``: whole on its rank, absent elsewhere.

    Args:
        index: The expert's position among its list's experts.
        count: How many experts the list has.
        enters: A first projection (its input comes from outside the expert).
    """

    collectives = ()
    name = "ep_whole_expert"

    def __init__(self, index: int, count: int, enters: bool) -> None:
        self.index, self.count, self.enters = index, count, enters

    def owner(self, world_size: int) -> int:
        """The rank that holds this expert."""
        return next(r for r in range(world_size)
                    if _holds(shard_range(self.count, world_size, r), self.index))

    def constraints(self, view: LinearView, fqn: str) -> list[Constraint]:
        return []  # any tp: a rank may hold no expert of a short list

    def layouts(self, view: LinearView, ctx: ShardContext) -> dict[str, ParamLayout]:
        held = self.owner(ctx.world_size) == ctx.rank
        return view.layouts(0, ((0, view.out_features),) if held else ())

    def detail(self, view: LinearView) -> str:
        return f"expert {self.index} of {self.count}" + (", its input enters" if self.enters
                                                          else "")

    def apply(self, module: nn.Module, layer: LayerPlan, ctx: ShardContext) -> nn.Module:
        weight, bias, trains = _shards(module, layer)
        out, inp = layer.full
        held = self.owner(ctx.world_size) == ctx.rank
        return ExpertLinear(weight.requires_grad_(trains),
                            None if bias is None else bias.requires_grad_(trains),
                            inp, out, held, self.enters, ctx.group, dict(layer.layouts))


def _holds(share: tuple[int, int], index: int) -> bool:
    start, length = share
    return start <= index < start + length


def whole_experts(model: nn.Module, plan: ResolvedPlan) -> dict[str, list[str]]:
    """Give each hand-written expert (a ``rowwise_partial`` Linear and its producers whose
    expert is an element of an ``nn.ModuleList``) :class:`WholeExpert`; per list, its experts.
    """
    lists: dict[str, list[tuple[int, str, tuple[str, ...]]]] = {}
    for name, style in plan.assignments.items():
        if not (isinstance(style, RowwisePartial) and style.producers):
            continue
        unit = _common_owner([name, *style.producers])
        parent, _, index = unit.rpartition(".")
        if index.isdigit() and isinstance(_get(model, parent), nn.ModuleList):
            lists.setdefault(parent, []).append((int(index), name, style.producers))
    for experts in lists.values():
        experts.sort()
        for i, (_, down, producers) in enumerate(experts):
            plan.assignments[down] = WholeExpert(i, len(experts), enters=False)
            for up in producers:
                plan.assignments[up] = WholeExpert(i, len(experts), enters=True)
    return {parent: [f"{parent}.{i}" for i, _, _ in experts] for parent, experts in lists.items()}


def _common_owner(names: list[str]) -> str:
    parts = [n.split(".")[:-1] for n in names]
    common: list[str] = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _get(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name) if name else model
    except AttributeError:
        return None
