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
A norm over all of a projection's heads (OLMo-2's ``q_norm`` over
``q_proj``'s whole output) is split with it
(:class:`~torchtp.plans.styles_heads.HeadNorm`), and so are the attention
module's own per-head parameters (GPT-OSS's ``sinks``,
:class:`~torchtp.plans.styles_heads.HeadParams`). Every cut follows one rule,
:func:`torchtp.core.layouts.head_share`. After the swap,
:func:`torchtp.plans.attention_local.localize_attention` gives each module its
local head counts.
"""

from __future__ import annotations

import torch
from torch import nn

from .head_boundaries import output_projection
from .heads import HeadInfo, head_info, head_parts, is_attention, output_part, query_part
from .linear_view import linear_view
from .resolved import ResolvedPlan
from .sources import head_config
from .styles import Colwise, Rowwise
from .styles_heads import (
    HeadColumns,
    HeadNorm,
    HeadParams,
    HeadSplit,
    Part,
    RopeKey,
    head_parameters,
    head_params_reason,
    norm_epsilon,
    shared_rope,
)


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
        _head_norms(plan, modules, name, parts)
    for parent_name, info in found.items():
        _rope_key(plan, modules, parent_name)
        cut_head_parameters(plan, modules[parent_name], parent_name, info)
    _head_columns(plan, modules, found)
    return found


def cut_head_parameters(plan: ResolvedPlan, module: nn.Module, name: str, info: HeadInfo
                        ) -> None:
    """Give a head-split attention module with per-head parameters (``sinks``) the style
    that cuts them with its heads (:class:`~torchtp.plans.styles_heads.HeadParams`)."""
    params = head_parameters(module, info.heads)
    if params:
        plan.assignments[name] = HeadParams(query_part(info))
        plan.why[name] = head_params_reason(params)


def _rope_key(plan: ResolvedPlan, modules: dict[str, nn.Module], attention: str) -> None:
    """Give a head-split latent attention's ``kv_a_proj_with_mqa`` its :class:`RopeKey`.

    Its last ``qk_rope_head_dim`` features are one key that every head reads,
    outside any split layer: without the style each rank's gradient of them would
    cover its own heads only. An attention whose projection is not found is refused.

    Raises:
        ValueError: a latent attention without a Linear child of ``kv_lora_rank +
            qk_rope_head_dim`` out_features (weight rows).
    """
    latent = shared_rope(modules[attention])
    if latent is None:
        return
    width = sum(latent)
    found = [name for name, module in modules.items()
             if name.rpartition(".")[0] == attention
             and getattr(linear_view(module), "out_features", None) == width
             and not isinstance(plan.assignments.get(name), Colwise)]
    # q_a_proj has that width too when q_lora_rank == kv_lora_rank + qk_rope_head_dim: HF's
    # name comes first (the head-split probe refuses a wrong pick: o_proj then reads a
    # projection that is neither split nor the rope key)
    found.sort(key=lambda name: not name.endswith(".kv_a_proj_with_mqa"))
    if found:
        plan.assignments[found[0]] = RopeKey(latent[1])
        plan.why[found[0]] = (f"mla_kv_a_proj: whole on every rank; the gradient of its last "
                              f"{latent[1]} features (the rope key every head of "
                              f"'{attention}' reads) summed over the ranks")
        return
    raise ValueError(
        f"attention '{attention}' ({type(modules[attention]).__name__}) is a multi-head latent "
        f"attention (kv_lora_rank={latent[0]}, qk_rope_head_dim={latent[1]}) split by whole "
        f"heads, but no Linear inside it has out_features={width} (weight rows): the rope key "
        "every head reads would get each rank's partial gradient. Keep its projections whole "
        "(plan= with them 'replicate') or report the architecture")


def _head_norms(plan: ResolvedPlan, modules: dict[str, nn.Module], producer: str,
                parts: tuple[Part, ...]) -> None:
    """Split the norm over all of ``producer``'s heads with it, if its attention has one.

    The norm is a sibling named like the projection (``q_norm`` for ``q_proj``,
    ``k_layernorm`` for ``k_proj``) with a 1-D weight as wide as its output; a
    norm over one head's ``head_dim`` needs nothing. The plan probe confirms the
    arithmetic before anything is cut (:mod:`torchtp.plans.verify`).
    """
    if len(parts) != 1:
        return
    parent, _, leaf = producer.rpartition(".")
    stem = leaf.split("_")[0]
    for name, module in modules.items():
        owner, _, child = name.rpartition(".")
        weight = getattr(module, "weight", None)
        if (owner != parent or child.split("_")[0] != stem or "norm" not in child.lower()
                or name in plan.assignments or not isinstance(weight, torch.Tensor)
                or weight.dim() != 1 or weight.shape[0] != parts[0].size
                or norm_epsilon(module) is None):
            continue
        plan.assignments[name] = HeadNorm(parts[0], producer)
        plan.why[name] = (f"head_norm: an RMS norm over every head of '{producer}', its weight "
                          "split with those heads, the mean of squares summed over the ranks")


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
        plan.assignments[name] = HeadColumns(output_part(info), style.name)
        plan.why[name] = (f"{plan.why.get(name, style.name)}; input columns by the whole "
                          f"query heads of attention '{parent_name}'")
