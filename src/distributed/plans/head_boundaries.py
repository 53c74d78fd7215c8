"""Which layer reads a head-split attention's output, and a wrap-time check that it cuts the same heads.

An attention whose query/key/value projections split their output rows
(weight rows) by whole heads (:class:`~torchtp.plans.styles_heads.HeadSplit`) hands
each rank ``local heads * head_dim`` features. The layer that reads them, the
output projection, must split its input columns (weight columns) at the same
head boundaries (:func:`torchtp.core.layouts.head_share`). That layer is not always
inside the attention module: BERT/RoBERTa keep q/k/v in ``attention.self`` and
the output projection in the sibling ``attention.output`` (``BertSelfOutput``).

:func:`output_projection` finds it by the plan's pairing: the first planned
layer after the producers, in module order, that splits its input columns and
reads ``heads * head_dim`` features (else one inside the attention module).
:func:`check_head_boundaries` compares the consumer's columns with the
producers' query-head rows for every rank, so every rank reaches the same
verdict without communicating, and refuses a disagreement at wrap time.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from .heads import HeadInfo
from .linear_view import LinearView, linear_view
from .styles import ParallelStyle, Rowwise, ShardContext
from .styles_heads import HeadNorm, HeadSplit, Part

Segments = tuple[tuple[int, int], ...]


def producers_of(attention: str, assignments: Mapping[str, ParallelStyle]) -> list[str]:
    """The head-split projections (weight rows by whole heads) inside ``attention``, in order."""
    lead = f"{attention}." if attention else ""
    return [n for n, s in assignments.items() if n.startswith(lead) and isinstance(s, HeadSplit)
            and s.parts is not None]


def output_projection(attention: str, info: HeadInfo, assignments: Mapping[str, ParallelStyle],
                      modules: Mapping[str, nn.Module]) -> str | None:
    """The planned layer that reads ``attention``'s output (its output projection), if any.

    The first planned layer after the last producer (module order) when it
    splits its input columns (``rowwise`` family) and reads ``heads * head_dim``
    features; otherwise such a layer inside ``attention`` (a projection
    registered before q/k/v).
    """
    producers = producers_of(attention, assignments)
    if not producers:
        return None
    names = list(assignments)
    width = info.heads * info.value_dim
    after = names[names.index(producers[-1]) + 1:]
    if after and _reads_heads(after[0], width, assignments, modules):
        return after[0]
    lead = f"{attention}." if attention else ""
    inside = [n for n in names if n.startswith(lead) and n not in producers
              and _reads_heads(n, width, assignments, modules)]
    return inside[0] if len(inside) == 1 else None


def _reads_heads(name: str, width: int, assignments: Mapping[str, ParallelStyle],
                 modules: Mapping[str, nn.Module]) -> bool:
    view = linear_view(modules[name])
    return isinstance(assignments[name], Rowwise) and view is not None \
        and view.in_features == width


def query_rows(style: HeadSplit, out_features: int, info: HeadInfo, ctx: ShardContext
               ) -> Segments | None:
    """The attention output features that the producer's query heads give ``ctx.rank``.

    ``None`` when the producer holds no query heads (a K/V-only projection).
    """
    for part in style.parts_for(out_features):
        if _is_query(part, info):  # heads -> attention output features (head_dim each)
            first, n = part.unit_range(ctx)
            return ((first * info.value_dim, n * info.value_dim),)
    return None


def _is_query(part: Part, info: HeadInfo) -> bool:
    """A part holding every query head (alone, or interleaved with K/V per head as in GPT-NeoX)."""
    return not part.is_kv and part.units == info.heads


def check_head_boundaries(heads: Mapping[str, HeadInfo], assignments: Mapping[str, ParallelStyle],
                          modules: Mapping[str, nn.Module], ctx: ShardContext) -> None:
    """Refuse a plan whose output projection cuts other heads than its q/k/v projections.

    Checked for every rank from the plan alone (no communication), so every
    rank raises the same error before any weight moves.

    Raises:
        ValueError: names the attention, both layers, their boundaries at this
            tp size and the fix.
    """
    for attention, info in heads.items():
        _check_head_params(attention, info, modules, ctx, assignments)
        consumer = output_projection(attention, info, assignments, modules)
        if consumer is None:
            continue
        style = assignments[consumer]
        assert isinstance(style, Rowwise)
        view = linear_view(modules[consumer])
        assert view is not None
        for producer in producers_of(attention, assignments):
            _check_pair(attention, info, producer, consumer, style, view, modules, assignments,
                        ctx)


def _check_pair(attention: str, info: HeadInfo, producer: str, consumer: str, style: Rowwise,
                view: LinearView, modules: Mapping[str, nn.Module],
                assignments: Mapping[str, ParallelStyle], ctx: ShardContext) -> None:
    split = assignments[producer]
    p_view = linear_view(modules[producer])
    assert isinstance(split, HeadSplit) and p_view is not None
    rows, cols = [], []
    for rank in range(ctx.world_size):
        at = ShardContext(ctx.world_size, rank, None, ctx.model_name)
        got = query_rows(split, p_view.out_features, info, at)
        if got is None:  # a K/V-only projection: its heads follow the query heads' groups
            return
        rows.append(got)
        cols.append(None if style.split_input else style.column_segments(view, at))
    if rows == cols:
        return
    shown_rows = ", ".join(_features(r) for r in rows)
    shown_cols = ("its full input, split by itself (style 'rowwise_split_input')"
                  if style.split_input else ", ".join(_features(c) for c in cols if c is not None))
    raise ValueError(
        f"attention '{attention}' ({info.heads} heads, head_dim {info.head_dim}) at "
        f"world_size={ctx.world_size} for {ctx.model_name}: '{producer}' splits its out_features "
        f"(weight rows) by whole heads, giving ranks 0..{ctx.world_size - 1} the attention "
        f"output features {shown_rows}, but '{consumer}', which reads that output "
        f"(in_features={view.in_features}), splits its in_features (weight columns) as {shown_cols}. "
        "The head boundaries must agree (torchtp.core.layouts.head_share); use the style 'rowwise' "
        "for it (torchtp then cuts its columns by the same heads), or a tp size that divides "
        f"the {info.heads} heads")


def _check_head_params(attention: str, info: HeadInfo, modules: Mapping[str, nn.Module],
                       ctx: ShardContext, assignments: Mapping[str, ParallelStyle]) -> None:
    """Refuse a per-head-grouped parameter inside a head-split attention (Cohere's ``q_norm``).

    A norm over ``head_dim`` (Qwen3's ``q_norm``) applies to any number of
    heads; one holding a row per head (weight ``(heads, head_dim)``) or the
    whole width (``heads * head_dim``) needs its rows cut by the same heads:
    only an RMS norm over a projection's whole output is (``head_norm``, OLMo-2's
    ``q_norm``); any other would fail or mix heads.
    """
    lead = f"{attention}." if attention else ""
    widths = {info.heads * info.head_dim: info.heads, info.kv_heads * info.head_dim: info.kv_heads}
    for name, module in modules.items():
        if not name.startswith(lead) or linear_view(module) is not None \
                or isinstance(assignments.get(name), HeadNorm):
            continue
        for pname, param in module.named_parameters(recurse=False):
            heads = widths.get(param.numel())
            if heads is None or heads < 2 or param.shape[0] not in (heads, param.numel()):
                continue
            raise ValueError(
                f"attention '{attention}' at world_size={ctx.world_size} for {ctx.model_name}: "
                f"its heads are split, but '{name}.{pname}' (shape {tuple(param.shape)}) holds "
                f"all {heads} heads' features; each rank would apply it to its own heads only. "
                "torchtp does not cut per-head-grouped parameters: keep this attention whole "
                "(plan= with its projections 'replicate', or 'colwise_gather_output' for q/k/v "
                "and 'rowwise_split_input' for the output projection)")


def _features(segments: Segments) -> str:
    return "+".join(f"[{s}:{s + n})" for s, n in segments)
