"""Which projections feed which: read from the autograd graph of one tiny forward.

Structural detection pairs projections by shape and tree order; this checks
the pairing against real dataflow. Forward hooks record the autograd node
that produced each Linear-like module's output; walking back from an output
projection's input must reach exactly the projections paired with it, and
no others (a wrong pair reaches the residual stream and earlier blocks).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.autograd.graph import Node

from .._torch_compat import node_inputs, node_metadata
from ..plans.linear_view import linear_view
from .compat import dummy_inputs

_TAG = "torchtp_producer"  # key in an autograd node's metadata: the module that made it


def trace_sources(model: nn.Module, names: Iterable[str]) -> dict[str, set[str]] | None:
    """For each module in ``names``, the Linear-like modules its input comes from.

    Runs ``model(**model.dummy_inputs)`` once with gradients enabled. Returns
    ``None`` when the model cannot run on its dummy inputs.
    """
    wanted = set(names)
    inputs: dict[str, Node | None] = {}
    hooks = []
    for name, mod in model.named_modules():
        if linear_view(mod) is None:
            continue
        hooks.append(mod.register_forward_hook(_recorder(name, wanted, inputs)))
    try:
        dummy = dummy_inputs(model)
        if dummy is None:
            return None
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        dummy = {k: (v.clamp(0, vocab - 1) if k == "input_ids" and vocab else v)
                 for k, v in dummy.items()}
        with torch.enable_grad():
            model(**dummy)
    except Exception:  # any model-specific failure just means: no dataflow evidence
        return None
    finally:
        for h in hooks:
            h.remove()
    return {n: _walk(node) for n, node in inputs.items()}


def _recorder(name: str, wanted: set[str], inputs: dict[str, Node | None]):
    # Tags live in the node's metadata, which stays with the C++ node: Python
    # wrappers (and their ids) can die and be reused while the graph lives on.
    def hook(_mod: nn.Module, args: tuple, out: object) -> None:
        if isinstance(out, torch.Tensor) and out.grad_fn is not None:
            node_metadata(out.grad_fn).setdefault(_TAG, name)
        if name in wanted and args and isinstance(args[0], torch.Tensor):
            inputs.setdefault(name, args[0].grad_fn)
    return hook


def _walk(start: Node | None) -> set[str]:
    found: set[str] = set()
    stack: list[Node | None] = [start]
    seen: dict[int, Node] = {}  # holding the wrappers keeps their ids unique
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        tag = node_metadata(node).get(_TAG)
        if tag is not None:
            found.add(tag)
            continue
        stack.extend(node_inputs(node))
    return found
