"""The forward door: everything torchtp checks per call of a wrapped model, in one place.

Safety is one service entered at three doors (docs/design.md): the wrap
(:mod:`torchtp.guards.checks`), each forward (this module) and each optimizer
step (:mod:`torchtp.guards.step_check`). At tp > 1, :func:`install` records
the model for the training features that look it up later (clipping, the
optimizer-step check) and puts three hooks on the wrapped model
(``base_model``), so they run however it is called (through the wrapper,
``TensorParallelTrainer``, ``generate``, a PEFT model around it):

* before the forward: refuse a DDP built before the model was sharded (only
  while a DDP runs a forward: :func:`torchtp.layers.ddp_guard.check_active_ddp`),
  refuse a hub kernel bound to a module the plan splits (only for models that
  have such modules: :func:`hub_kernel_modules`),
  report a backward through an earlier output that raised on this rank, mark
  the forward running, hash the inputs to ride the step's first collective
  (:class:`torchtp.guards.input_check.InputCheck`);
* when it returned: watch the backward through its output, read the input
  verdict;
* always, also when it raised (``always_call``): report an escaped exception
  to the other ranks, drop a hash that did not ride, forget the inputs shared
  by sibling layers within the forward.

The steps that only run on a failure (the reports) live in
:mod:`torchtp.guards.forward_guard`, so a forward that succeeds enters this
module and the input check's only. In training mode the pre-hook also
switches the default generator to the TP group's shared RNG stream and the
``always`` hook switches it back (:func:`torchtp.layers.rng.enter_model`), so
the streams hold however the model is called; the parallel layers switch
between the shared and local streams inline. Nothing runs under
``torch.compile``. At tp 1 nothing cross-rank needs checking: no hook is
installed, and the model draws dropout masks from the caller's generator,
exactly as the unwrapped model does. ``benchmarks/percall_guards.py``
measures the door's per-call cost.
"""

from __future__ import annotations

import sys
import weakref
import zlib
from types import MethodType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import regions, tensor_memo
from ..comm.health import state
from ..core import torch_compat as _torch_compat
from ..layers import ddp_guard, rng
from ..layers.parallel_linear import ParallelLinear
from ..plans import ShardContext
from ..training import clip
from . import forward_guard, step_check
from .input_check import InputCheck, first_layer_shard_width

# (module name, module, its hub kernel layer, the split module at or under it)
HubKernelSite = tuple[str, nn.Module, str, str]


class ForwardDoor:
    """The per-call safety of one wrapped model (see the module docstring).

    Args:
        model: The wrapped model (``wrapper.base_model``), already sliced.
        ctx: Where the shards went.
        layer_names: The swapped layers, in module order.
    """

    def __init__(self, model: nn.Module, ctx: ShardContext, layer_names: list[str]) -> None:
        # The group's state (it holds the group weakly: comm.health.GroupState)
        self.st = state(ctx.group)
        self.inputs = InputCheck(model, self.st, first_layer_shard_width(model, layer_names))
        self.running = False  # a forward began and has not returned (for the fault report)
        self.model = weakref.ref(model)  # for the RNG streams' refusals (rng.site)
        self.streamed = False  # this forward switched the RNG streams (rng.enter_model)
        # Modules a hub kernel could run in place of the split (kernelized before the wrap,
        # or later: train()/eval() re-kernelizes): usually none
        self.kernels = hub_kernel_modules(model, layer_names)

    def before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook.

        Raises:
            RuntimeError: traced by ``torch.compile`` in training mode with dropout:
                compiled code does not switch the RNG streams (decided at trace time,
                from the modules the model holds then, adapters added after the wrap
                included).
        """
        if torch.compiler.is_compiling():
            if module.training:
                where = rng.dropout_site(module)
                if where is not None:
                    raise rng.refuse_compiled_dropout(where, self.st.size)
            return
        if _torch_compat.active_ddp() is not None:  # a DDP runs its forward into us
            ddp_guard.check_active_ddp(module)
        if self.kernels:
            refuse_hub_kernels(self.kernels)
        if module.training:  # replicated regions draw from the TP group's shared stream
            if self.streamed:  # an exception the hooks never saw (KeyboardInterrupt) left it
                rng.exit_model()
            rng.enter_model(self.model)
            self.streamed = True
        if not dist.is_initialized():
            return
        self.running = False
        if self.st.backward_open and not _torch_compat.in_backward():
            forward_guard.report_failed_backward(self.st)
        self.running = True
        self.inputs.before(args, kwargs)

    def returned(self, _module: nn.Module, _args: tuple[Any, ...], _kwargs: dict[str, Any],
                 out: Any) -> None:
        """Forward hook: the forward returned ``out``."""
        if torch.compiler.is_compiling() or not self.running:
            return
        self.running = False
        if torch.is_grad_enabled():
            forward_guard.watch_backward(self.st, out)
        self.inputs.returned(out)

    def always(self, _module: nn.Module, _args: tuple[Any, ...], _kwargs: dict[str, Any],
               _out: Any) -> None:
        """Forward hook that also runs when the forward raised (``always_call``)."""
        if torch.compiler.is_compiling():
            return
        if self.running:  # the forward raised: "returned" did not run
            self.running = False
            err = sys.exc_info()[1]  # torch calls always_call hooks inside its except
            if err is not None and dist.is_initialized():
                forward_guard.report_escaped(self.st, err)
        if self.streamed:  # the user's generator state back
            self.streamed = False
            rng.exit_model()
        self.inputs.cleanup()
        if tensor_memo.KEPT:  # region entries would keep the forward's graph alive
            regions.forget_shared_inputs()


def hub_kernel_modules(model: nn.Module, split: list[str]) -> list[HubKernelSite]:
    """``(name, module, kernel layer, split module)`` for every module of the sliced
    ``model`` a hub kernel may run in place of torchtp's split: the modules named in
    ``split`` (swapped or cut in place) and their ancestors whose class the ``kernels``
    library marked (``kernel_layer_name``, set by transformers'
    ``use_kernel_forward_from_hub``: GPT-OSS's MoE block, Qwen3.5's gated delta-net).
    A module torchtp replaced by a layer of its own carries no kernel.

    ``kernelize`` (transformers' ``use_kernels=True``, its default from 5.25 where
    ``kernels`` is installed, and again at every ``train()``/``eval()`` that changes
    the mode) binds the kernel's forward to such a module on CUDA, before the wrap or
    after it. That forward computes from the parameters itself, without the collectives
    or the local head counts of the split, so the door checks for it before every forward.
    """
    found: dict[str, HubKernelSite] = {}
    for name in split:
        parts = name.split(".")
        for i in range(len(parts), -1, -1):
            owner = ".".join(parts[:i])
            module = model.get_submodule(owner)
            layer = getattr(type(module), "kernel_layer_name", None)
            if owner not in found and isinstance(layer, str):
                found[owner] = (owner, module, layer, name)
    return list(found.values())


def refuse_hub_kernels(watched: list[HubKernelSite]) -> None:
    """Raise :class:`RuntimeError` if a hub kernel's forward replaced one of ``watched`` (see
    :func:`hub_kernel_modules`): ``kernels`` binds it to the instance (``MethodType``);
    its fallback and ``reset_kernels`` remove it again. The same verdict on every rank:
    every rank kernelizes its model alike."""
    for name, module, layer, split in watched:
        if isinstance(vars(module).get("forward"), MethodType):
            raise RuntimeError(
                f"'{name or type(module).__name__}' ({type(module).__name__}) runs the hub "
                f"kernel '{layer}' (kernelized: transformers' use_kernels=True, the default "
                "from 5.25 when the kernels package is installed): the kernel's forward "
                f"replaces the module's own and computes from the parameters of '{split}' "
                "itself, without the collectives and local sizes of torchtp's split, so its "
                "results would be wrong; load the model with use_kernels=False or call "
                "model.set_use_kernels(False) (and do not turn it on again), or keep "
                f"'{split}' whole with plan={{'{split}': 'replicate'}}")


def install(model: nn.Module, ctx: ShardContext, layer_names: list[str]) -> None:
    """At tp > 1: record ``model`` for the training features, key each parallel layer's
    split-region RNG stream by its name, and hook its forward.

    Args:
        model: The wrapped model (``wrapper.base_model``), already sliced.
        ctx: Where the shards went.
        layer_names: The swapped layers, in module order.
    """
    if ctx.world_size == 1:  # one rank holds everything: nothing to agree on or look up
        return
    clip.track(model, ctx.group)
    step_check.track(model, ctx.group)
    ddp_guard.install()  # later DDPs leave the shards alone
    if ctx.group is None:  # a planning-only wrap (world_size given, no group): no forward runs
        return
    for name, module in model.named_modules():
        if isinstance(module, ParallelLinear):  # its split regions' RNG stream key
            module.stream_key = zlib.crc32(name.encode())
    door = ForwardDoor(model, ctx, layer_names)
    model.register_forward_pre_hook(door.before, with_kwargs=True)
    model.register_forward_hook(door.returned, with_kwargs=True)
    model.register_forward_hook(door.always, with_kwargs=True, always_call=True)
