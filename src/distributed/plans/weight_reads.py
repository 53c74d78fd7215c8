"""Parameters read outside their own module's forward, seen on the probe forward.

A Linear split by a plan holds a shard of its weight: its own forward (the parallel
layer's) knows it, but code elsewhere that reads the weight itself, such as
``F.linear(x, self.fc1.weight)`` in a parent's forward, a penalty on
``self.fc2.weight.norm()`` or an attention module concatenating its projections'
weights, would read the shard as if it were the whole weight, silently. The automatic
plan keeps such a Linear whole.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .dataflow import Inputs, probe_mode


def read_elsewhere(model: nn.Module, inputs: Inputs) -> dict[int, str]:
    """``{id(module): the op}`` for each module one of whose own parameters an op of the
    probe forward (eval mode, no gradients) read while that module's forward was not
    running."""
    owners: dict[int, list[nn.Module]] = {}  # a tied parameter has several
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(m)
    running: dict[int, int] = {}  # id(module) -> forwards of it under way
    found: dict[int, str] = {}

    def enter(module: nn.Module, *_: Any) -> None:
        running[id(module)] = running.get(id(module), 0) + 1

    def leave(module: nn.Module, *_: Any) -> None:
        running[id(module)] -= 1

    class _Watch(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                               kwargs: dict[str, Any] | None = None) -> Any:
            kwargs = kwargs or {}
            for value in _tensors(itertools.chain(args, kwargs.values())):
                held = owners.get(id(value), [])
                if held and not any(running.get(id(m)) for m in held):
                    for module in held:
                        found.setdefault(id(module), getattr(func, "__name__", str(func)))
            return func(*args, **kwargs)

    holders = {id(m): m for ms in owners.values() for m in ms}.values()
    # First in, last out: another library's hooks (device placement) run inside the forward
    hooks = [h for m in holders for h in (
        m.register_forward_pre_hook(enter, prepend=True),
        m.register_forward_hook(leave, always_call=True))]
    args, kwargs = inputs
    try:
        with probe_mode(model), torch.no_grad(), _Watch():
            model(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return found


def _tensors(values: Iterable[Any]) -> Iterable[torch.Tensor]:
    """The tensors among ``values``, one level into lists and tuples (an op's operands)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))
