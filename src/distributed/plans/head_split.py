"""Upgrade the plan's sharded attention projections to whole-head splits (a resolve step).

For every module whose query/key/value projections the plan shards,
:func:`split_whole_heads` replaces their styles by a
:class:`~torchtp.plans.styles_heads.HeadSplit` that splits whole heads, and
says so in the plan's ``why`` (shown by ``describe_plan()``). Whole KV groups
(a KV head and its query heads) are shared out balanced when tp is at most the
number of KV heads; with more ranks, each KV head is replicated on the ranks
that use it and its query heads are split over them (vLLM's approach), see
:func:`torchtp.core.layouts.group_share`. Shares may differ by a head or a KV group:
nothing has to divide. Fused ``qkv`` projections are split part by part, and
the output projection's input columns follow the same query heads
(:class:`~torchtp.plans.styles_heads.HeadColumns`), wherever that projection
lives (found by :func:`~torchtp.plans.head_boundaries.output_projection`).
Every cut follows one rule, :func:`torchtp.core.layouts.head_share`. After the
swap, :func:`torchtp.plans.attention_local.localize_attention` gives each
module its local head counts.
"""

from __future__ import annotations

from torch import nn

from .head_boundaries import output_projection
from .heads import HeadInfo, head_info, head_parts, is_attention, query_part
from .linear_view import linear_view
from .resolved import ResolvedPlan
from .sources import head_config
from .styles import Colwise, Rowwise
from .styles_heads import HeadColumns, HeadSplit


def split_whole_heads(model: nn.Module, plan: ResolvedPlan) -> dict[str, HeadInfo]:
    """Upgrade styles of sharded attention projections to whole-head splits.

    Each upgrade is recorded in ``plan.why`` (and so in ``describe_plan()``).

    Returns:
        ``{attention module name: HeadInfo}`` for the modules whose heads are
        split (to be adjusted after the swap).
    """
    config = head_config(model)
    modules = dict(model.named_modules())
    found: dict[str, HeadInfo] = {}
    for name, style in list(plan.assignments.items()):
        if not isinstance(style, Colwise) or style.gather_output:
            continue
        parent_name = name.rpartition(".")[0]
        parent = modules.get(parent_name)
        view = linear_view(modules[name])
        if parent is None or view is None or not is_attention(parent):
            continue
        info = head_info(parent, config)
        parts = head_parts(view.out_features, style.name, info) if info else None
        if parts is None:
            plan.notes.append(f"'{name}': its out_features={view.out_features} do not map onto "
                              f"attention heads ({info}); split as rows only")
            continue
        assert info is not None  # parts is None whenever info is
        plan.assignments[name] = HeadSplit(parts, style.name)
        plan.why[name] = (f"{plan.why.get(name, style.name)}; whole heads of attention "
                          f"'{parent_name}' ({info.heads} heads, {info.kv_heads} KV heads, "
                          f"head_dim {info.head_dim})")
        found[parent_name] = info
    _head_columns(plan, modules, found)
    return found


def _head_columns(plan: ResolvedPlan, modules: dict[str, nn.Module],
                  found: dict[str, HeadInfo]) -> None:
    """Split each head-split attention's output projection by the same whole heads.

    The output projection is found by the plan's pairing (it may live outside
    the attention module, as BERT's ``attention.output.dense``); only a plain
    ``rowwise`` one is upgraded: any other is left for
    :func:`~torchtp.plans.head_boundaries.check_head_boundaries` to judge.
    """
    for parent_name, info in found.items():
        name = output_projection(parent_name, info, plan.assignments, modules)
        style = plan.assignments.get(name) if name is not None else None
        if name is None or type(style) is not Rowwise or style.split_input:
            continue
        plan.assignments[name] = HeadColumns(query_part(info), style.name)
        plan.why[name] = (f"{plan.why.get(name, style.name)}; input columns by the whole "
                          f"query heads of attention '{parent_name}'")
