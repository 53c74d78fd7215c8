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

from ..plans.linear_view import LinearView, linear_view
from ..plans.resolved import Rules
from .attention import _is_attention, _parts, head_info
from .dataflow import trace_sources
from .detect import text_config


def _block_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """Outermost ModuleLists holding Linear-like modules (encoder and decoder stacks)."""
    found: list[tuple[str, nn.ModuleList]] = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or not len(mod):
            continue
        if any(name.startswith(f"{outer}.") for outer, _ in found):
            continue
        if any(linear_view(m) is not None for m in mod.modules()):
            found.append((name, mod))
    return found


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
    # The output projection writes the hidden state and is registered last
    # (tree order stands in for dataflow); every other projection reads it.
    out_name, out_view = members[-1]
    inputs = members[:-1]
    if out_view.out_features != hidden or not inputs:
        return {}, "no projection pair ending in one output projection back to the hidden size"
    if any(v.in_features != hidden for _, v in inputs):
        return {}, "a projection before the output one does not read the hidden state"
    if _is_attention(parent):
        if len(inputs) not in (1, 3):
            return {}, "attention needs q, k, v (or one fused qkv) projections and an output one"
        return _attention_pair(parent, inputs, out_name, out_view, config)
    inner = out_view.in_features
    if all(v.out_features == inner for _, v in inputs):
        return {**{n: "colwise" for n, _ in inputs}, out_name: "rowwise"}, None
    if len(inputs) == 1 and inputs[0][1].out_features == 2 * inner:
        return {inputs[0][0]: "packed_colwise", out_name: "rowwise"}, None
    return {}, "input projections do not share the output projection's inner width"


def _attention_pair(parent: nn.Module, inputs: list[tuple[str, LinearView]], out_name: str,
                    out_view: LinearView, config: object) -> tuple[dict[str, str], str | None]:
    info = head_info(parent, config)
    own = [n for n, m in parent.named_children()
           if linear_view(m) is None and any(True for _ in m.parameters())]
    if own:
        return {}, (f"it has parameterized submodules {own} (e.g. per-head norms) whose place "
                    "in the dataflow decides their gradient; pass plan= "
                    "('replicated_with_grad_allreduce' for per-head norms)")
    if info is None or out_view.in_features != info.heads * info.head_dim:
        return {}, "attention projections do not match the head geometry"
    fused = (info.heads + 2 * info.kv_heads) * info.head_dim
    if any(v.out_features == fused for _, v in inputs):
        return {}, ("a fused q/k/v projection whose layout (stacked or interleaved per head) "
                    "cannot be told from its shape; pass plan= ('packed_colwise' if stacked, "
                    "'colwise' if interleaved)")
    if any(_parts(v.out_features, "colwise", info) is None for _, v in inputs):
        return {}, "a projection's out_features do not map onto the attention heads"
    return {**{n: "colwise" for n, _ in inputs}, out_name: "rowwise"}, None


def structural_plan(model: nn.Module) -> Rules:
    """Detect a plan from the module tree; unsure parts stay replicated with a note."""
    config = text_config(model)
    hidden = next((getattr(config, a) for a in ("hidden_size", "n_embd", "d_model")
                   if isinstance(getattr(config, a, None), int)), None)
    stacks = _block_lists(model)
    if not stacks or hidden is None:
        return Rules("structural detection", {}, [
            "structural detection found no repeated blocks or no hidden size: everything "
            "stays replicated; pass plan= to shard"])
    rules: dict[str, str] = {}
    notes: list[str] = []
    checked = True
    for list_name, blocks in stacks:
        found, ok = _detect_stack(model, list_name, blocks, hidden, config, notes)
        rules.update(found)
        checked = checked and ok
    source = "structural detection" + ((" (pairs checked against dataflow)" if checked
                                        else " (tree order only)") if rules else "")
    return Rules(source, rules, notes)


def _detect_stack(model: nn.Module, list_name: str, blocks: nn.ModuleList, hidden: int,
                  config: object, notes: list[str]) -> tuple[dict[str, str], bool]:
    """Rules for one stack of blocks, and whether dataflow confirmed them."""
    rules: dict[str, str] = {}
    for parent_name, members in _linears_by_parent(blocks[0]).items():
        parent = blocks[0].get_submodule(parent_name) if parent_name else blocks[0]
        styles, why = _pair(parent, members, hidden, config)
        where = f"{list_name}.*.{parent_name}".rstrip(".")
        if why:
            notes.append(f"'{where}' kept replicated: {why}")
        for child, style in styles.items():
            rules[f"{where}.{child}"] = style
    if not _same_in_every_block(blocks, rules, list_name):
        notes.append(f"blocks of '{list_name}' differ in structure: they stay replicated; "
                     "pass plan= to shard")
        return {}, True
    if not rules:
        return {}, True
    return _confirm_dataflow(model, rules, list_name, notes)


def _confirm_dataflow(model: nn.Module, rules: dict[str, str], list_name: str,
                      notes: list[str]) -> tuple[dict[str, str], bool]:
    """Keep only the pairs whose output projection is fed by exactly its inputs."""
    first = f"{list_name}.0."
    concrete = {r.replace(f"{list_name}.*.", first, 1): style for r, style in rules.items()}
    outputs = [n for n, style in concrete.items() if style == "rowwise"]
    sources = trace_sources(model, outputs)
    if sources is None:
        notes.append("could not run the model on its dummy inputs to check dataflow: pairs "
                     "follow module tree order")
        return rules, False
    kept: dict[str, str] = {}
    for out in outputs:
        parent = out.rpartition(".")[0] + "."
        inputs = {n for n, s in concrete.items() if n.startswith(parent) and n != out
                  and n.count(".") == out.count(".")}
        pattern = lambda n: n.replace(first, f"{list_name}.*.", 1)  # noqa: E731
        if sources.get(out) == inputs:
            kept.update({pattern(n): concrete[n] for n in (*sorted(inputs), out)})
        else:
            notes.append(f"'{pattern(parent.rstrip('.'))}' kept replicated: its output projection "
                         f"reads {sorted(sources.get(out, set()))}, not the paired "
                         f"{sorted(inputs)}")
    return kept, True


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
