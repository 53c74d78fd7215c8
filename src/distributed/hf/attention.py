"""Attention modules after their projections are split by heads.

Two steps around the swap:

1. :func:`split_whole_heads` (while resolving the plan): for every module whose
   query/key/value projections the plan shards, replace their styles by a
   :class:`~torchtp.hf.styles.HeadSplit` that splits whole heads, and say so in
   the plan's ``why`` (shown by ``describe_plan()``). Whole KV groups (a KV
   head and its query heads) are shared out balanced when tp is at most the
   number of KV heads; with more ranks, each KV head is replicated on the
   ranks that use it and its query heads are split over them (vLLM's
   approach), see :func:`torchtp.layouts.group_share`. Shares may differ by a
   head or a KV group: nothing has to divide. Fused ``qkv`` projections are
   split part by part, and the output projection's input columns follow the
   same query heads (:class:`~torchtp.hf.styles.HeadColumns`), wherever that
   projection lives (found by :func:`~torchtp.hf.head_pairs.output_projection`).
   Every cut follows one rule, :func:`torchtp.layouts.head_share`.
2. :func:`localize_attention` (after the swap): rewrite the attributes the
   module's forward reads (head counts, widths, ``num_key_value_groups`` and a
   per-module copy of ``config``) to their local values.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.utils.hooks import RemovableHandle

from ..layouts import head_share
from ..plans.linear_view import linear_view
from ..plans.resolved import ResolvedPlan
from ..plans.styles import Colwise, Rowwise, ShardContext
from . import compat
from .compat import HEAD_ATTRS, HEAD_DIM_ATTRS, KV_ATTRS
from .detect import text_config
from .head_pairs import output_projection
from .styles import HeadColumns, HeadSplit, Part


@dataclass(frozen=True)
class HeadInfo:
    """Head geometry of one attention module."""

    heads: int
    kv_heads: int
    head_dim: int


def _first_int(obj: object, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def head_info(module: nn.Module, config: object) -> HeadInfo | None:
    """Heads, KV heads and head size of ``module`` (its own attributes first, then config)."""
    heads = _first_int(module, HEAD_ATTRS) or _first_int(config, ("num_attention_heads", "n_head"))
    if heads is None:
        return None
    kv = _first_int(module, KV_ATTRS) or _first_int(config, ("num_key_value_heads", "num_kv_heads",
                                                             "n_head_kv"))
    if kv is None:
        kv = 1 if getattr(config, "multi_query", False) else heads
    hidden = _first_int(config, ("hidden_size", "n_embd", "d_model"))
    head_dim = (_first_int(module, HEAD_DIM_ATTRS) or _first_int(config, ("head_dim",))
                or (hidden // heads if hidden else None))
    return HeadInfo(heads, kv, head_dim) if head_dim else None


def _is_attention(module: nn.Module) -> bool:
    if any(hasattr(module, a) for a in HEAD_ATTRS + KV_ATTRS + HEAD_DIM_ATTRS):
        return True
    return "attention" in type(module).__name__.lower() or "attn" in type(module).__name__.lower()


def query_part(info: HeadInfo) -> Part:
    """The query heads as a part split by whole heads, keeping KV groups together."""
    return Part(info.heads * info.head_dim, info.heads, "num_attention_heads (query heads)",
                kv_groups=info.kv_heads)


def _parts(rows: int, style_name: str, info: HeadInfo) -> tuple[Part, ...] | None:
    """How a projection's output rows map to heads, or None if they do not."""
    h, k, d = info.heads, info.kv_heads, info.head_dim
    q = query_part(info)
    kv = Part(k * d, k, "num_key_value_heads (key/value heads)", kv_groups=k, is_kv=True)
    if rows == h * d:
        return (q,)
    if rows == k * d:
        return (kv,)
    if rows == (h + 2 * k) * d:
        if style_name == "packed_colwise":  # [q | k | v] stacked
            return (q, kv, kv)
        if k == h:  # per-head interleaved [q k v] groups (GPT-NeoX): whole heads stay together
            return (Part(rows, h, "num_attention_heads (fused q/k/v heads)"),)
    return None


def split_whole_heads(model: nn.Module, plan: ResolvedPlan) -> dict[str, HeadInfo]:
    """Upgrade styles of sharded attention projections to whole-head splits.

    Each upgrade is recorded in ``plan.why`` (and so in ``describe_plan()``).

    Returns:
        ``{attention module name: HeadInfo}`` for the modules whose heads are
        split (to be adjusted after the swap).
    """
    config = text_config(model) if hasattr(model, "config") else None
    modules = dict(model.named_modules())
    found: dict[str, HeadInfo] = {}
    for name, style in list(plan.assignments.items()):
        if not isinstance(style, Colwise) or style.gather_output:
            continue
        parent_name = name.rpartition(".")[0]
        parent = modules.get(parent_name)
        view = linear_view(modules[name])
        if parent is None or view is None or not _is_attention(parent):
            continue
        info = head_info(parent, config)
        parts = _parts(view.out_features, style.name, info) if info else None
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
    :func:`~torchtp.hf.head_pairs.check_head_boundaries` to judge.
    """
    for parent_name, info in found.items():
        name = output_projection(parent_name, info, plan.assignments, modules)
        style = plan.assignments.get(name) if name is not None else None
        if name is None or type(style) is not Rowwise or style.split_input:
            continue
        plan.assignments[name] = HeadColumns(query_part(info), style.name)
        plan.why[name] = (f"{plan.why.get(name, style.name)}; input columns by the whole "
                          f"query heads of attention '{parent_name}'")


def local_heads(info: HeadInfo, ctx: ShardContext) -> tuple[int, int]:
    """This rank's ``(query heads, KV heads)`` by :func:`torchtp.layouts.head_share`."""
    (_, heads), (_, kv) = head_share(info.heads, info.kv_heads, ctx.world_size, ctx.rank)
    return heads, kv


def localize_attention(model: nn.Module, infos: dict[str, HeadInfo], ctx: ShardContext) -> None:
    """Set each head-split attention module's head counts and widths to this rank's values.

    Per-head biases passed into the module (ALiBi) are narrowed to its heads too.
    """
    for name, info in infos.items():
        heads, kv = local_heads(info, ctx)
        module = model.get_submodule(name)
        compat.localize_attention(module, info.heads, info.kv_heads, info.head_dim, heads, kv)
        narrow_head_biases(module, info, ctx)


def narrow_head_biases(module: nn.Module, info: HeadInfo, ctx: ShardContext
                       ) -> RemovableHandle | None:
    """Give ``module`` this rank's query heads of the per-head biases it is passed, if any."""
    (first, count), _ = head_share(info.heads, info.kv_heads, ctx.world_size, ctx.rank)
    return compat.narrow_head_biases(module, info.heads, first, count)


def local_overrides(module: nn.Module, info: HeadInfo, ctx: ShardContext) -> dict[str, object]:
    """The attributes of ``module`` to set on this rank when its heads are split."""
    heads, kv = local_heads(info, ctx)
    return compat.local_attention_values(module, info.heads, info.kv_heads, info.head_dim,
                                         heads, kv)
