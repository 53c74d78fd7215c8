"""The ``moe_tp_experts`` style: tensor parallelism inside every expert of an HF experts module.

transformers' MoE plans name the experts module (``"layers.*.mlp.experts":
"moe_tp_experts"``) and, under it, its 3-D parameters (``"...experts.gate_up_proj":
"packed_colwise"``, ``"...experts.down_proj": "rowwise"``). The style plans the
parameters itself (:attr:`ExpertsTP.covers`), from the layout flags that
transformers' ``use_experts_implementation`` sets on the module:

=================  =========================================================
flag               this rank keeps, for every expert ``e``
=================  =========================================================
concatenated       ``gate_up_proj`` rows ``[s, s+n)`` of the gate half and
                   ``[I+s, I+s+n)`` of the up half (weight rows, like ``colwise``)
interleaved        ``gate_up_proj`` rows ``[2s, 2s+2n)`` (gate/up pairs)
``down_proj``      columns ``[s, s+n)`` (weight columns, like ``rowwise``)
``is_transposed``  the same features, on the other dimension
=================  =========================================================

where ``[s, s+n)`` is this rank's balanced share of the ``I`` intermediate
features (:func:`torchtp.core.layouts.shard_range`), cut in blocks of
:func:`feature_block` features: ``grouped_mm`` (transformers' default experts
kernel) needs every row of ``down_proj`` to start on a 16-byte boundary, so at
tp 3 an ``I = 32`` in float32 is kept as 12/12/8 features, never 11/11/10.

Experts with biases (GPT-OSS): ``gate_up_proj_bias`` ``(E, 2I)`` keeps the same
features as ``gate_up_proj`` (along dim 1), and ``down_proj_bias`` ``(E, H)``
stays whole on every rank and is added by one rank of the features' ranks
(:class:`~torchtp.ep.experts.ParallelExperts`), so the all-reduce adds it once,
as :class:`~torchtp.layers.ColumnParallelLinear` adds its bias. Experts with a
norm after each expert are refused: their output is not a sum of per-rank
partial outputs.

``ep_dispatch_experts`` (:class:`ExpertsEP`, HF's expert-parallel plan, or
``DistributedModelWrapper(..., expert_parallel=True)``) keeps whole experts
instead: rank ``r`` holds experts ``[s, s+n)`` of ``E`` (balanced) with every
parameter whose first dimension counts experts, biases and per-expert norms
included, and the ranks' outputs are summed by the same one all-reduce.

``ExpertsEP(ep=k)`` (``expert_parallel=k``) folds both into the TP group of
``tp`` ranks: ``k`` expert-parallel ranks times ``tp/k`` ranks inside each
expert. Rank ``r`` holds experts ``shard_range(E, k, r // (tp/k))`` and, of
each, the features ``shard_range(I, tp/k, r % (tp/k))``: a block of each 3-D
parameter, cut along two dimensions (:attr:`ParamLayout.second` holds the
experts' range). The same one all-reduce over the TP group sums every block's
partial output.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import nn

from ..core.layouts import ParamLayout, shard_range
from ..plans.constraints import Constraint, MultipleOf
from ..plans.sources import ExpertsLayout, experts_layout
from ..plans.styles import LayerPlan, ParallelStyle, ShardContext, split_constraint
from .dispatch import DISPATCH, Dispatch
from .experts import shard_experts

GATE_UP, DOWN, UP = "gate_up_proj", "down_proj", "up_proj"
# The experts' parameters an experts style plans itself (HF plans may name them too)
COVERS = (GATE_UP, DOWN, UP, f"{GATE_UP}_bias", f"{DOWN}_bias", f"{UP}_bias")

_ALL_REDUCE = ("every rank sees every token (HF's 'all_reduce' expert parallelism): routes to "
               "other ranks' experts are masked, one all-reduce per MoE layer sums the outputs")
_DISPATCH_DETAIL = {
    "all_reduce": _ALL_REDUCE,
    "all_to_all": "all-to-all dispatch: each rank routes its slice of the tokens to the "
                  "experts' ranks and back, then one all-gather (a route-hash all-gather first)",
    "auto": "dispatch chosen per call by the cost model (expert_dispatch_times, from the "
            "call's shapes): all-to-all (each rank routes its slice of the tokens; four "
            "collectives instead of the all-reduce) where it is estimated faster, else "
            f"{_ALL_REDUCE}",
}


class ExpertsTP(ParallelStyle):
    """Split every expert's intermediate features over the TP ranks (one all-reduce per layer)."""

    name = "moe_tp_experts"
    covers = COVERS

    def plan(self, module: nn.Module, fqn: str, ctx: ShardContext) -> LayerPlan:
        experts, inter, layout = _geometry(module, fqn)
        gate_up = getattr(module, _in_name(layout))
        constraints: tuple[Constraint, ...] = (split_constraint(
            self.name, fqn, "intermediate_size", "features of every expert", inter),)
        full = tuple(gate_up.shape)
        if not all(c.ok(ctx.world_size) for c in constraints):
            return LayerPlan(fqn, self.name, constraints, full, collectives=("all_reduce",))
        layouts = _layouts(module, inter, layout, ctx)
        detail = (f"{experts} experts: each keeps its share of intermediate_size={inter} "
                  f"({layouts[DOWN].segments[0][1]} on this rank): "
                  f"{'gate/up' if layout.has_gate else 'up'} weight rows, down "
                  "weight columns; one all-reduce per MoE layer; the router stays replicated "
                  f"(every rank routes every token){_bias_detail(layout)}")
        return LayerPlan(fqn, self.name, constraints, full, layouts[_in_name(layout)].local_shape,
                         layouts, ("all_reduce",), detail)

    def apply(self, module: nn.Module, layer: LayerPlan, ctx: ShardContext) -> nn.Module:
        if ctx.world_size == 1 or not layer.layouts:
            return module
        layout = _layout(module, layer.fqn, self.name)
        return shard_experts(module, dict(layer.layouts), ctx.group, ctx.world_size, ctx.rank,
                             name=layer.fqn, routed=layout.routed,
                             bias_first=_bias_first(layout, layer.layouts))


def check_expert_parallel(ep: object) -> None:
    """Raise unless ``ep`` is ``True`` or a positive int (``expert_parallel``'s values)."""
    if ep is True or (isinstance(ep, int) and not isinstance(ep, bool) and ep >= 1):
        return
    raise ValueError(f"expert_parallel={ep!r}: give True (whole experts per rank) or the number "
                     "of expert-parallel ranks, a positive int dividing the tensor-parallel size")


def _layout(module: nn.Module, fqn: str, style: str) -> ExpertsLayout:
    """The family's description of an experts module, or a TypeError saying what is needed."""
    layout = experts_layout(module)
    if layout is None:
        raise TypeError(f"plan style {style!r} for module '{fqn}' ({type(module).__name__}) "
                        "needs a transformers experts module (num_experts and 3-D expert "
                        "weights); use 'replicate' or remove the rule")
    return layout


def _geometry(module: nn.Module, fqn: str,
              style: str = "moe_tp_experts") -> tuple[int, int, ExpertsLayout]:
    """``(experts, intermediate_size, layout)`` of an HF experts module, or a ValueError
    saying why its experts' features cannot be split."""
    who = f"plan style {style!r} for module '{fqn}' ({type(module).__name__})"
    layout = _layout(module, fqn, style)
    if layout.post_norm:
        raise ValueError(f"{who}: has_post_expert_norm=True: a norm after each expert is not "
                         "linear in the partial outputs, so its output is not the sum of the "
                         "ranks' partial outputs; use expert_parallel=True (whole experts per "
                         "rank) or keep the experts whole with plan={'<pattern>': 'replicate'}")
    name = _in_name(layout)
    gate_up, down = getattr(module, name), getattr(module, DOWN)
    e, rows = gate_up.shape[0], gate_up.shape[2 if layout.transposed else 1]
    inter = down.shape[1 if layout.transposed else 2]
    hidden = down.shape[2 if layout.transposed else 1]
    if rows != (2 if layout.has_gate else 1) * inter or down.shape[0] != e:
        raise ValueError(f"{who}: '{name}' {tuple(gate_up.shape)} and '{DOWN}' "
                         f"{tuple(down.shape)} do not describe {e} "
                         f"{'gated ' if layout.has_gate else ''}experts")
    for bias, shape in ((f"{name}_bias", (e, rows)), (f"{DOWN}_bias", (e, hidden))):
        held = getattr(module, bias, None)
        if layout.has_bias and (not isinstance(held, torch.Tensor)
                                or tuple(held.shape) != shape):
            raise ValueError(f"{who}: has_bias=True, but '{bias}' is {_shape_text(held)}, not "
                             f"a tensor of shape {shape} (one bias per expert and feature); "
                             "set has_bias to match the module's parameters")
        if not layout.has_bias and held is not None:
            raise ValueError(f"{who}: has_bias=False, but the module holds '{bias}' "
                             f"{_shape_text(held)}: its forward may add it, which the split "
                             "would not cut or add once; set has_bias to match the module's "
                             "parameters")
    return e, inter, layout


def _shape_text(value: object) -> str:
    return f"of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)


def _bias_detail(layout: ExpertsLayout) -> str:
    """For ``describe_plan()``: where the experts' biases go when their features are split."""
    if not layout.has_bias:
        return ""
    return (f"; the {_in_name(layout)} bias keeps the rows its weight keeps, the {DOWN} bias "
            "stays whole and is added by the first rank sharing each expert's features")


def _bias_first(layout: ExpertsLayout, layouts: Mapping[str, ParamLayout]) -> bool | None:
    """Whether this rank adds the experts' ``down_proj_bias``: the rank whose share of the
    features starts at feature 0, one of the ranks sharing each expert's features (``None``
    without biases)."""
    return layouts[DOWN].segments[0][0] == 0 if layout.has_bias else None


def _in_name(layout: ExpertsLayout) -> str:
    """The experts' input projection: ``gate_up_proj``, or ``up_proj`` without a gate."""
    return GATE_UP if layout.has_gate else UP


def feature_block(inter: int, parts: int, itemsize: int) -> int:
    """Features per block of an expert's ``inter`` features split over ``parts`` ranks.

    ``grouped_mm`` rejects a ``down_proj`` whose rows do not start on a 16-byte
    boundary, so a block is 16 bytes of the weights' dtype (4 float32 or 8
    bfloat16 features), halved until it divides ``inter`` and leaves every rank
    at least one block: a share of whole blocks is aligned whenever the unsharded
    experts are. The dtype is the one the model is wrapped in (cast a model to
    bfloat16 before wrapping it, as ``from_pretrained(dtype=...)`` does).

    Example:
        >>> feature_block(32, 3, 4), feature_block(32, 3, 2), feature_block(30, 4, 4)
        (4, 8, 2)
    """
    block = max(1, 16 // itemsize)
    while block > 1 and (inter % block or inter // block < parts):
        block //= 2
    return block


def _layouts(module: nn.Module, inter: int, layout: ExpertsLayout,
             ctx: ShardContext) -> dict[str, ParamLayout]:
    """This rank's layout of ``gate_up_proj`` and ``down_proj``, and of ``gate_up_proj_bias``
    with biases (see the module docstring)."""
    down = getattr(module, DOWN)
    block = feature_block(inter, ctx.world_size, down.element_size())
    start, n = shard_range(inter // block, ctx.world_size, ctx.rank, block)
    transposed = layout.transposed
    if not layout.has_gate:  # up_proj only: feature i is row i
        gate_up_rows: tuple[tuple[int, int], ...] = ((start, n),)
    elif layout.concatenated:
        gate_up_rows = ((start, n), (inter + start, n))
    else:  # gate/up interleaved: feature i is rows 2i and 2i+1
        gate_up_rows = ((2 * start, 2 * n),)
    name = _in_name(layout)
    gate_up = getattr(module, name)
    layouts = {name: ParamLayout(tuple(gate_up.shape), 2 if transposed else 1, gate_up_rows),
               DOWN: ParamLayout(tuple(down.shape), 1 if transposed else 2, ((start, n),))}
    if layout.has_bias:  # (E, 2I): the features gate_up_proj keeps; down_proj_bias stays whole
        bias = getattr(module, f"{name}_bias")
        layouts[f"{name}_bias"] = ParamLayout(tuple(bias.shape), 1, gate_up_rows)
    return layouts


class ExpertsEP(ParallelStyle):
    """Place whole experts on the TP ranks (expert parallel over the same ranks), or blocks
    of experts x features with ``ep``; all-reduce or all-to-all dispatch.

    Args:
        ep: Expert-parallel ranks within the TP group: experts are placed over
            ``ep`` ranks and each expert's features split over the ``tp/ep``
            ranks that share them. ``None`` (the registry's style): ``ep = tp``,
            whole experts.
        dispatch: How tokens reach whole experts (``ep = tp``): ``"all_reduce"``
            (every rank runs its experts on all their tokens, one all-reduce),
            ``"all_to_all"`` (each rank routes a slice of the tokens to the
            experts' ranks and back, :mod:`torchtp.ep.dispatch`) or
            ``"auto"`` (per call, whichever the cost model estimates cheaper for
            the call's shapes). Blocks (``ep < tp``) use the all-reduce.
    """

    name = "ep_dispatch_experts"
    covers = COVERS

    def __init__(self, ep: int | None = None, dispatch: Dispatch = "auto") -> None:
        if ep is not None:
            check_expert_parallel(ep)
        if dispatch not in DISPATCH:
            raise ValueError(f"expert_dispatch={dispatch!r} is not a dispatch path; valid: "
                             f"{list(DISPATCH)}")
        self.ep, self.dispatch = ep, dispatch

    def plan(self, module: nn.Module, fqn: str, ctx: ShardContext) -> LayerPlan:
        experts = _expert_count(module, fqn)
        ep = self._ep(ctx.world_size, fqn)
        constraints = (split_constraint(self.name, fqn, "num_experts", "whole experts", experts),)
        params = dict(module.named_parameters(recurse=False))
        full = tuple(params[GATE_UP if GATE_UP in params else "up_proj"].shape)
        if ep == ctx.world_size and not all(c.ok(ctx.world_size) for c in constraints):
            return LayerPlan(fqn, self.name, constraints, full, collectives=("all_reduce",))
        if ep < ctx.world_size:
            if self.dispatch == "all_to_all":
                raise ValueError(f"module '{fqn}' (style {self.name!r}): expert_dispatch="
                                 f"'all_to_all' needs whole experts per rank (expert_parallel="
                                 f"True), but expert_parallel={ep} at world_size="
                                 f"{ctx.world_size} splits each expert's features too; use "
                                 "expert_dispatch='all_reduce' or expert_parallel=True")
            return self._plan_folded(module, fqn, ctx, ep, experts, full)
        first, count = shard_range(experts, ctx.world_size, ctx.rank)
        layouts = {name: ParamLayout(tuple(p.shape), 0, ((first, count),))
                   for name, p in params.items() if p.dim() >= 1 and p.shape[0] == experts}
        dispatch = self._dispatch(ctx.world_size)
        detail = (f"{experts} experts placed whole, {count} on this rank ({first}..."
                  f"{first + count - 1}); {_DISPATCH_DETAIL[dispatch]}; the router stays "
                  "replicated")
        collectives = ("all_gather", "all_to_all", "all_to_all", "all_gather") \
            if dispatch == "all_to_all" else ("all_reduce",)
        return LayerPlan(fqn, self.name, constraints, full, (count, *full[1:]), layouts,
                         collectives, detail)

    def __repr__(self) -> str:
        if self.ep is None and self.dispatch == "auto":
            return repr(self.name)
        return f"ExpertsEP(ep={self.ep}, dispatch={self.dispatch!r})"

    def _dispatch(self, tp: int) -> Dispatch:
        """The dispatch whole experts use at ``tp``: all-to-all moves fewer bytes only when
        ``tp > 2k`` (``k >= 1``), so at ``tp <= 2`` ``"auto"`` is the all-reduce."""
        return "all_reduce" if self.dispatch == "auto" and tp <= 2 else self.dispatch

    def _ep(self, tp: int, fqn: str) -> int:
        """The expert-parallel size at tensor-parallel size ``tp`` (a divisor of it); at tp 1
        nothing is split, whatever ``ep`` asks for (a script for more ranks run alone)."""
        if self.ep is None or tp == 1:
            return tp
        if tp % self.ep:
            valid = [d for d in range(1, tp + 1) if tp % d == 0]
            raise ValueError(f"module '{fqn}' (style {self.name!r}): expert_parallel={self.ep} "
                             f"does not divide the tensor-parallel size world_size={tp} (experts "
                             f"over ep ranks, each expert's features over tp/ep ranks); valid "
                             f"expert_parallel values at this size: {valid}")
        return self.ep

    def _plan_folded(self, module: nn.Module, fqn: str, ctx: ShardContext, ep: int,
                     experts: int, full: tuple[int, ...]) -> LayerPlan:
        """Experts over ``ep`` ranks, each expert's features over ``tp/ep`` (blocks)."""
        inner = ctx.world_size // ep
        _, inter, layout = _geometry(module, fqn, self.name)
        where = f"module '{fqn}' (style {self.name!r})"
        constraints = (MultipleOf(where, "expert_parallel", ep),
                       Constraint(where, "intermediate_size x expert_parallel (features of "
                                  "every expert, over tp/expert_parallel ranks)", inter * ep))
        if experts < ep or inter < inner:
            valid = [d for d in range(1, ctx.world_size + 1)
                     if ctx.world_size % d == 0 and d <= experts and ctx.world_size // d <= inter]
            raise ValueError(f"module '{fqn}' (style {self.name!r}): expert_parallel={ep} at "
                             f"world_size={ctx.world_size} places num_experts={experts} over {ep} "
                             f"ranks and intermediate_size={inter} features over {inner}; each "
                             f"rank needs at least one of each; valid expert_parallel values: "
                             f"{valid}")
        ep_rank, inner_rank = divmod(ctx.rank, inner)
        first, count = shard_range(experts, ep, ep_rank)
        feature = ShardContext(inner, inner_rank, ctx.group, ctx.model_name)
        layouts = {name: replace(lay, second=(0, first, count))
                   for name, lay in _layouts(module, inter, layout, feature).items()}
        if layout.has_bias:  # (E, H): this rank's experts, added by one rank of each block
            bias = getattr(module, f"{DOWN}_bias")
            layouts[f"{DOWN}_bias"] = ParamLayout(tuple(bias.shape), 0, ((first, count),))
        share = layouts[DOWN].segments[0][1]
        detail = (f"{experts} experts over ep={ep} ranks, {count} on this rank ({first}..."
                  f"{first + count - 1}), each expert's intermediate_size={inter} over "
                  f"tp/ep={inner} ranks ({share} here): gate/up weight rows, down weight columns; "
                  "every rank sees every token, routes to other ranks' experts are masked, one "
                  "all-reduce per MoE layer sums the outputs; the router stays replicated"
                  f"{_bias_detail(layout)}")
        return LayerPlan(fqn, self.name, constraints, full, layouts[_in_name(layout)].local_shape,
                         layouts, ("all_reduce",), detail)

    def apply(self, module: nn.Module, layer: LayerPlan, ctx: ShardContext) -> nn.Module:
        if ctx.world_size == 1 or not layer.layouts:
            return module
        lay = next(iter(layer.layouts.values()))
        first, count = lay.second[1:] if lay.second is not None else lay.segments[0]
        layout = _layout(module, layer.fqn, self.name)
        layout.mark_parallel(module)
        dispatch = self._dispatch(ctx.world_size) if lay.second is None else "all_reduce"
        # Blocks: the ranks sharing an expert's features each hold its whole down_proj_bias;
        # whole experts hold their own
        bias_first = _bias_first(layout, layer.layouts) if lay.second is not None else None
        return shard_experts(module, dict(layer.layouts), ctx.group, ctx.world_size, ctx.rank,
                             expert_range=(first, count),
                             forward=layout.parallel_forward, name=layer.fqn, dispatch=dispatch,
                             bias_first=bias_first)


def _expert_count(module: nn.Module, fqn: str) -> int:
    """``E`` of an HF experts module whose forward skips sentinel routes, or why not."""
    layout = _layout(module, fqn, "ep_dispatch_experts")
    if not layout.routed:
        raise ValueError(f"plan style 'ep_dispatch_experts' for module '{fqn}' "
                         f"({type(module).__name__}): its forward takes every expert's rows "
                         "already routed (Llama 4), not routes a rank could keep to its own "
                         "experts; split every expert's features instead (expert_parallel=False)")
    if not layout.sentinel:
        raise ValueError(f"plan style 'ep_dispatch_experts' for module '{fqn}' "
                         f"({type(module).__name__}): this transformers release's experts "
                         "forward cannot skip routes to another rank's experts (it has no "
                         "expert-parallel sentinel); upgrade transformers (5.24 has it) or split "
                         "every expert's features instead (expert_parallel=False)")
    return int(module.__dict__["num_experts"])  # an int: experts_layout checked it
