"""Structural detection: a plan for HF models that ship none.

The repeated blocks are the largest ``nn.ModuleList``. Inside the first
block, Linear-like modules are grouped by parent; a parent whose projections
read the hidden state and whose one output projection writes it back is a
TP pair (one all-reduce): an attention block when the projections map onto
its heads, an MLP when they share one inner width. Registration order must
put the inputs before the output. Anything else stays replicated, with a
note saying why; no Linear ever gets its own all-gather. The plan is checked
to hold for every block, then written with ``*`` for the block index.
"""

from __future__ import annotations

from torch import nn

from ..plans import ResolvedPlan, match_plan
from ..plans.linear_view import LinearView, linear_view
from .attention import _is_attention, _parts, head_info
from .detect import text_config


def _block_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return None
    return max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))


def _linears_by_parent(block: nn.Module) -> dict[str, list[tuple[str, LinearView]]]:
    groups: dict[str, list[tuple[str, LinearView]]] = {}
    for name, mod in block.named_modules():
        view = linear_view(mod)
        if view is not None:
            groups.setdefault(name.rpartition(".")[0], []).append((name.rpartition(".")[2], view))
    return groups


def _pair(parent: nn.Module, members: list[tuple[str, LinearView]], hidden: int,
          config: object) -> tuple[dict[str, str], str | None]:
    """Styles for one parent's projections, or ({}, reason it stays replicated)."""
    outputs = [(n, v) for n, v in members if v.out_features == hidden and v.in_features != hidden]
    inputs = [(n, v) for n, v in members if v.in_features == hidden]
    if len(outputs) != 1 or not inputs or len(inputs) + 1 != len(members):
        return {}, "not exactly one output projection back to the hidden size"
    out_name, out_view = outputs[0]
    order = [n for n, _ in members]
    if any(order.index(n) > order.index(out_name) for n, _ in inputs):
        return {}, "an input projection is registered after the output projection"
    if _is_attention(parent):
        info = head_info(parent, config)
        if info is None or out_view.in_features != info.heads * info.head_dim:
            return {}, "attention projections do not match the head geometry"
        if any(_parts(v.out_features, "colwise", info) is None for _, v in inputs):
            return {}, "a fused attention projection whose q/k/v layout cannot be told apart"
        return {**{n: "colwise" for n, _ in inputs}, out_name: "rowwise"}, None
    inner = out_view.in_features
    if all(v.out_features == inner for _, v in inputs):
        return {**{n: "colwise" for n, _ in inputs}, out_name: "rowwise"}, None
    if len(inputs) == 1 and inputs[0][1].out_features == 2 * inner:
        return {inputs[0][0]: "packed_colwise", out_name: "rowwise"}, None
    return {}, "input projections do not share the output projection's inner width"


def structural_plan(model: nn.Module) -> ResolvedPlan:
    """Detect a plan from the module tree; unsure parts stay replicated with a note."""
    config = text_config(model)
    hidden = next((getattr(config, a) for a in ("hidden_size", "n_embd", "d_model")
                   if isinstance(getattr(config, a, None), int)), None)
    found = _block_list(model)
    if found is None or hidden is None:
        plan = match_plan(model, {}, "structural detection")
        plan.notes.append("structural detection found no repeated blocks or no hidden size: "
                          "everything stays replicated; pass plan= to shard")
        return plan
    list_name, blocks = found
    rules: dict[str, str] = {}
    notes: list[str] = []
    for parent_name, members in _linears_by_parent(blocks[0]).items():
        parent = blocks[0].get_submodule(parent_name) if parent_name else blocks[0]
        styles, why = _pair(parent, members, hidden, config)
        where = f"{list_name}.*.{parent_name}".rstrip(".")
        if why:
            notes.append(f"'{where}' kept replicated: {why}")
        for child, style in styles.items():
            rules[f"{where}.{child}"] = style
    if not _same_in_every_block(blocks, rules, list_name):
        rules, notes = {}, [f"blocks of '{list_name}' differ in structure: everything stays "
                            "replicated; pass plan= to shard"]
    plan = match_plan(model, rules, "structural detection")
    plan.notes.extend(notes)
    return plan


def _same_in_every_block(blocks: nn.ModuleList, rules: dict[str, str], list_name: str) -> bool:
    lead = f"{list_name}.*."
    names = [r[len(lead):] for r in rules]
    first = blocks[0]
    for block in blocks[1:]:
        for name in names:
            try:
                a, b = linear_view(first.get_submodule(name)), linear_view(block.get_submodule(name))
            except AttributeError:
                return False
            if a is None or b is None or (a.in_features, a.out_features) != (
                    b.in_features, b.out_features):
                return False
    return True
