"""Whether a residual layer's output less its input depends on its input at all.

``reduce_residual`` computes a layer's output as ``x + all-reduce(out_r - x)``
and passes the output's gradient to ``x`` and to every rank's parts
unchanged. That is exact only if ``out - x`` does not depend on ``x``: a gate
computed from ``x`` (``x + sigmoid(x) * (a + m)``), dropout on the residual
(``dropout(x) + a + m``, training mode only) or a scaled residual would each
leave a term in ``x``'s gradient that holds only this rank's part. The rule,
checked on the autograd graph between the output and ``x`` (stopping at the
parts' outputs), in eval and in training mode: exactly one node reads ``x``,
it is a plain addition, and every node from it to the output is a plain
addition too. Tensors a forward leaves on its modules (an auxiliary loss)
must not be computed from the parts' outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..core.torch_compat import is_plain_add, node_inputs
from .dataflow import Inputs, kept_on_modules, probe_mode
from .module_io import first_input, first_output


def path_problem(out_node: Any, x_node: Any, part_nodes: set[int]) -> str | None:
    """Why ``out - x`` may depend on ``x`` in this graph (``None``: it does not).

    Args:
        out_node: The autograd node of the layer's output.
        x_node: The autograd node of its input (the residual).
        part_nodes: Ids of the autograd nodes of its parts' outputs.
    """
    region: dict[int, Any] = {}
    stack = [out_node]
    while stack:
        node = stack.pop()
        if node is None or node is x_node or id(node) in part_nodes or id(node) in region:
            continue
        region[id(node)] = node
        stack.extend(node_inputs(node))
    # Each edge into x counts (x + x reads it twice from one node).
    readers = [n for n in region.values() for i in node_inputs(n) if i is x_node]
    if len(readers) != 1:
        return (f"is not possible: its input is read {len(readers)} times on the way to its "
                "output (a gate or a scale computed from the residual?)")
    node = out_node
    while True:
        if node is None or not is_plain_add(node):
            return (f"is not possible: {type(node).__name__} lies between its input and its "
                    "output (the residual must only be added to)")
        if node is readers[0]:
            return None
        node = next((i for i in node_inputs(node) if i is not None
                     and _reaches(i, {id(readers[0])}, region)), None)


def _reaches(start: Any, targets: set[int], region: dict[int, Any] | None = None) -> bool:
    """Whether walking back from ``start`` (inside ``region`` when given) meets a node of
    ``targets`` (ids)."""
    stack, seen = [start], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        if id(node) in targets:
            return True
        if region is not None and id(node) not in region:
            continue
        seen.add(id(node))
        stack.extend(node_inputs(node))
    return False


def training_problems(model: nn.Module, inputs: Inputs,
                      layers: list[tuple[str, list[str]]]) -> dict[str, str | None]:
    """Per layer (with its parts), :func:`path_problem` on one training-mode forward (dropout
    active), and whether a kept tensor (``self.l_aux = ...``) is computed from its parts."""
    seen: dict[str, Any] = {}
    handles: list[RemovableHandle] = []
    try:
        for layer, parts in layers:
            for name in parts:
                handles.append(model.get_submodule(name).register_forward_hook(
                    _output_node(name, seen)))
            handles.append(model.get_submodule(layer).register_forward_hook(
                _layer_nodes(layer, seen), with_kwargs=True))
        args, kwargs = inputs
        with probe_mode(model, training=True), torch.enable_grad():
            model(*args, **kwargs)
        kept = [t.grad_fn for t in kept_on_modules(model)]
    except Exception as err:
        failed = f"failed in the training-mode probe ({type(err).__name__}: {err})"
        return {layer: failed for layer, _ in layers}
    finally:
        for handle in handles:
            handle.remove()
    return {layer: _training_verdict(layer, parts, seen, kept) for layer, parts in layers}


def _training_verdict(layer: str, parts: list[str], seen: dict[str, Any],
                      kept: list[Any]) -> str | None:
    if f"{layer}:out" not in seen or any(p not in seen for p in parts):
        return "is not possible: in training mode the layer or its parts are not called"
    part_nodes = {id(seen[p]) for p in parts}
    problem = path_problem(seen[f"{layer}:out"], seen[f"{layer}:x"], part_nodes)
    if problem is not None:
        return f"{problem} (in training mode)"
    if any(_reaches(n, part_nodes) for n in kept):
        return ("is not possible: a tensor kept on a module (an auxiliary loss?) is computed "
                "from the parts' outputs, and its gradient would cover only this rank's part")
    return None


def _output_node(name: str, seen: dict[str, Any]) -> Callable[..., None]:
    def hook(_m: nn.Module, _args: object, out: object) -> None:
        if isinstance(out, torch.Tensor):
            seen[name] = out.grad_fn
    return hook


def _layer_nodes(layer: str, seen: dict[str, Any]) -> Callable[..., None]:
    def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: object) -> None:
        x, y = first_input(args, kwargs), first_output(out)
        if x is not None and y is not None:
            seen[f"{layer}:x"], seen[f"{layer}:out"] = x.grad_fn, y.grad_fn
    return hook
