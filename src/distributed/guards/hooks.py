"""What runs per call of a wrapped model, installed once: the pipeline's last step.

The wrapper's pipeline is resolve → agree → apply → hooks. At tp > 1,
:func:`install` records the model for the training features that look it up
later (clipping, the optimizer-step check) and puts three hooks on
the wrapped model (``base_model``), so they run however it is called (through
the wrapper, ``TensorParallelTrainer``, ``generate``, a PEFT model around it):

* one forward pre-hook: refuse a DDP built before the model was sharded
  (:func:`torchtp.layers.ddp_guard.check_active_ddp`) and PEFT adapters built
  without torchtp's PEFT support (a check the wrapper passes in), mark the
  forward pending for the fault report (:class:`torchtp.guards.forward_guard.ForwardGuard`), hash the
  inputs to ride the first all-reduce (:class:`torchtp.guards.input_check.InputCheck`);
* one forward hook when the forward returned: watch its backward, read the
  input verdict;
* one forward hook that also runs when it raised (``always_call``): report an
  escaped exception, drop a hash that did not ride, forget the inputs shared
  by sibling layers within the forward.

The RNG streams' layer hooks are the wrapper's (``train(mode)``, training
mode only). Nothing runs under ``torch.compile``. At tp 1 nothing cross-rank needs
checking: no hook is installed, and the model draws dropout masks from the
caller's generator, exactly as the unwrapped model does.
``benchmarks/percall_guards.py`` measures each guard's per-call cost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..comm import regions
from ..layers import ddp_guard
from ..plans import ShardContext
from ..training import clip
from . import step_check
from .forward_guard import ForwardGuard
from .input_check import InputCheck, first_layer_shard_width


def install(model: nn.Module, ctx: ShardContext, layer_names: list[str],
            framework_checks: tuple[Callable[[nn.Module], None], ...] = ()) -> None:
    """At tp > 1: record ``model`` for the training features and hook its forward.

    Args:
        model: The wrapped model (``wrapper.base_model``), already sliced.
        ctx: Where the shards went.
        layer_names: The swapped layers, in module order.
        framework_checks: Checks of the integrations layer to run before each
            forward (given by the wrapper: this layer may not import them).
    """
    if ctx.world_size == 1:  # one rank holds everything: nothing to agree on or look up
        return
    clip.track(model)
    step_check.track(model, ctx.group)
    ddp_guard.install()  # later DDPs leave the shards alone
    faults = ForwardGuard(ctx.group)
    inputs = InputCheck(model, ctx.group, ctx.world_size,
                        first_layer_shard_width(model, layer_names))
    before: list[Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]] = [
        lambda m, _a, _k: ddp_guard.check_active_ddp(m),
        *(_model_step(check) for check in framework_checks),
        lambda _m, _a, _k: faults.before(),
        lambda _m, a, k: inputs.before(a, k),
    ]
    returned: list[Callable[[Any], None]] = [faults.returned, inputs.returned]
    always: list[Callable[[], None]] = [faults.after, inputs.cleanup,
                                        regions.forget_shared_inputs]
    _register(model, tuple(before), tuple(returned), tuple(always))


def _model_step(check: Callable[[nn.Module], None]) -> Callable[
        [nn.Module, tuple[Any, ...], dict[str, Any]], None]:
    def step(module: nn.Module, _args: tuple[Any, ...], _kwargs: dict[str, Any]) -> None:
        check(module)
    return step


def _register(model: nn.Module,
              before: tuple[Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None], ...],
              returned: tuple[Callable[[Any], None], ...],
              always: tuple[Callable[[], None], ...]) -> None:
    """Three hooks on ``model`` that run the guards' steps in order (none when compiling)."""

    def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not torch.compiler.is_compiling():
            for step in before:
                step(module, args, kwargs)

    def post(_module: nn.Module, _args: tuple[Any, ...], _kwargs: dict[str, Any],
             out: Any) -> None:
        if not torch.compiler.is_compiling():
            for step in returned:
                step(out)

    def last(_module: nn.Module, _args: tuple[Any, ...], _kwargs: dict[str, Any],
             _out: Any) -> None:
        if not torch.compiler.is_compiling():
            for step in always:
                step()

    if before:
        model.register_forward_pre_hook(pre, with_kwargs=True)
    if returned:
        model.register_forward_hook(post, with_kwargs=True)
    if always:
        model.register_forward_hook(last, with_kwargs=True, always_call=True)
