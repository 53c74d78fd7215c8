"""Every use of a private or version-sensitive torch name, in one place.

Code elsewhere in torchtp calls these functions instead of touching torch
internals, so a torch release that changes one of them breaks one function
here (and ``make compat`` says which), not a dozen call sites.
``tests/distributed/test_compat_fence.py`` fails when a torch private name is
used outside this module and ``hf/compat.py``.

Each entry names the torch releases it was checked against (``make compat``
runs them); ``CHECKED_TORCH`` is that list.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import torch
from torch import nn

CHECKED_TORCH = ("2.13.0", "2.14.1")

M = TypeVar("M", bound=nn.Module)


def set_module_tensor(module: nn.Module, name: str, tensor: torch.Tensor, is_param: bool) -> None:
    """Put ``tensor`` into ``module``'s parameter or buffer slot ``name`` as is.

    Writes ``nn.Module._parameters`` / ``_buffers`` directly, so no
    ``__setattr__`` override or registration hook runs and the slot keeps its
    kind (a non-persistent buffer stays non-persistent); owners of a tied
    weight all receive the same object.
    Checked: torch 2.13.0.
    """
    (module._parameters if is_param else module._buffers)[name] = tensor  # type: ignore[assignment]


def persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``module``'s own buffers that go into its ``state_dict`` (not ``persistent=False`` ones).

    Reads ``nn.Module._non_persistent_buffers_set``: ``state_dict`` would say the
    same but recurses and detaches.
    Checked: torch 2.13.0.
    """
    skip: set[str] = module._non_persistent_buffers_set
    for name, buf in module.named_buffers(recurse=False):
        if name not in skip:
            yield name, buf


def shallow_copy_module(module: M) -> M:
    """A shallow copy of ``module`` that shares its buffers but has its own parameter dict.

    Assigning a parameter on the copy leaves ``module`` untouched.
    Checked: torch 2.13.0, 2.14.1.
    """
    probe = copy.copy(module)
    probe._parameters = dict(module._parameters)
    return probe


def registered_child(module: nn.Module, name: str) -> nn.Module | None:
    """The child ``name`` registered on ``module``, read without ``__getattr__``.

    For use inside a ``__getattr__`` override, where ``getattr`` would recurse.
    Checked: torch 2.13.0, 2.14.1.
    """
    children: dict[str, nn.Module | None] = module.__dict__["_modules"]
    return children.get(name)


def node_metadata(node: Any) -> dict[str, Any]:
    """The per-node dict of an autograd ``Node`` (``torch.autograd.graph.Node.metadata``).

    A property at runtime, declared a method in torch's type stubs; it lives
    with the C++ node, so it survives the Python wrapper being freed.
    Checked: torch 2.13.0, 2.14.1.
    """
    metadata: dict[str, Any] = node.metadata
    return metadata


def node_inputs(node: Any) -> Iterator[Any]:
    """The autograd nodes ``node`` passes gradients to (``next_functions``, ``None`` kept).

    Checked: torch 2.13.0, 2.14.1.
    """
    for fn, _ in getattr(node, "next_functions", ()):
        yield fn


def watch_ddp_construction(callback: Callable[[Any, nn.Module], None]) -> None:
    """Call ``callback(ddp, module)`` inside every later ``DistributedDataParallel(module)``.

    Registers torch's public global module-registration hook once per process
    (``torch.nn.modules.module.register_module_module_registration_hook``); it
    runs on every ``parent.child = module`` in the process, so it only compares
    the attribute name and the parent's type. In torch 2.13
    ``DistributedDataParallel.__init__`` first reads
    ``module._ddp_params_and_buffers_to_ignore`` into ``parameters_to_ignore``
    and lists ``_module_parameters``, then assigns ``self.module = module``
    (this hook), and only afterwards builds its reducer's parameters and
    broadcasts rank 0's (``_build_params_for_reducer``, ``_sync_module_states``,
    both filtered by ``parameters_to_ignore``): the callback runs before any
    collective of DDP's, and an exception it raises leaves DDP's constructor.
    Checked: torch 2.13.0, 2.14.1.
    """
    from torch.nn.modules.module import register_module_module_registration_hook

    if callback in _DDP_WATCHERS:
        return
    _DDP_WATCHERS.append(callback)
    if len(_DDP_WATCHERS) == 1:
        register_module_module_registration_hook(on_module_registration)


_DDP_WATCHERS: list[Callable[[Any, nn.Module], None]] = []


def on_module_registration(parent: nn.Module, name: str, child: Any) -> None:
    """The hook :func:`watch_ddp_construction` registers (cheap: one string compare).

    Checked: torch 2.13.0, 2.14.1.
    """
    if name == "module" and isinstance(parent, _ddp_class()) and isinstance(child, nn.Module):
        for watcher in _DDP_WATCHERS:
            watcher(parent, child)


@functools.cache
def _ddp_class() -> type:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def ddp_leave_alone(ddp: Any, module: nn.Module, names: list[str]) -> None:
    """Make a ``DistributedDataParallel`` being built around ``module`` leave ``names`` alone.

    Adds them to ``ddp.parameters_to_ignore`` (read by its broadcast and its
    reducer) and drops their tensors from ``ddp._module_parameters`` (read by
    the Python reducer's hooks), as if the module had listed them in
    ``_ddp_params_and_buffers_to_ignore``. A root-level parameter ``"w"`` is
    also added as ``".w"``: the reducer builds ``f"{module_name}.{name}"``.
    Called from :func:`watch_ddp_construction`'s callback only.
    Checked: torch 2.13.0, 2.14.1.

    Raises:
        ValueError: nothing trainable would be left for DDP to average.
    """
    ddp.parameters_to_ignore.update(names)
    ddp.parameters_to_ignore.update(f".{n}" for n in names if "." not in n)
    kept = [p for n, p in module.named_parameters() if n not in ddp.parameters_to_ignore]
    if not any(p.requires_grad for p in kept):
        raise ValueError(
            f"DistributedDataParallel over {type(module).__name__}: every trainable "
            "parameter is split over the tensor-parallel group DDP spans, so DDP would average "
            "nothing; drop DDP, or give it process_group=cfg.dp_group from "
            "init_tensor_parallel(tp_size=...) for data parallelism")
    ddp._module_parameters = kept


def active_ddp() -> Any:
    """The ``DistributedDataParallel`` whose forward is running its module now, else ``None``.

    ``DistributedDataParallel._get_active_ddp_module()``: DDP sets it around
    ``self.module(...)`` in its forward (not with the Python reducer).
    Checked: torch 2.13.0, 2.14.1.
    """
    return _ddp_class()._get_active_ddp_module()  # type: ignore[attr-defined]


def ddp_parameters(ddp: Any) -> list[torch.Tensor]:
    """The parameters a ``DistributedDataParallel`` took from its module at construction.

    ``ddp._module_parameters`` (its reducer's are those that require grad).
    Checked: torch 2.13.0, 2.14.1.
    """
    params: list[torch.Tensor] = ddp._module_parameters
    return params


def implicit_replication() -> AbstractContextManager[None]:
    """DTensor's implicit replication: plain tensors mixed with DTensors act as replicated.

    ``torch.distributed.tensor.experimental.implicit_replication`` (experimental
    namespace, so fenced here). It flips one process-wide flag and restores the
    previous value on exit, so nested uses must exit in reverse order.
    Checked: torch 2.13.0, 2.14.1.
    """
    from torch.distributed.tensor.experimental import implicit_replication as replicate

    return replicate()


def is_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view of another tensor (it has a ``_base``).

    An autograd.Function output that is a view cannot be modified in place later.
    Checked: torch 2.13.0.
    """
    return tensor._base is not None


def at_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward pass now running completes without an error.

    Only valid while autograd runs a backward (e.g. from a node hook). The
    engine runs queued callbacks after the whole graph task succeeded and
    drops them when the backward raised, which is what lets torchtp notice a
    backward that failed on one rank (see :mod:`torchtp.comm.health`).
    Checked: torch 2.13.0.
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def in_backward() -> bool:
    """Whether this thread is running inside an autograd backward pass (e.g. a recompute).

    Checked: torch 2.13.0.
    """
    return bool(torch._C._current_graph_task_id() != -1)


def use_count(tensor: torch.Tensor) -> int:
    """How many C++ references the tensor's implementation has (the Python object is one).

    A collective's work object holds references to its tensors until it is
    destroyed, so a drop tells that the backend has let go of the work.
    Checked: torch 2.13.0.
    """
    return int(tensor._use_count())  # type: ignore[attr-defined]


def version_counter(tensor: torch.Tensor) -> int:
    """The in-place version counter of ``tensor``, shared with its views.

    Every in-place change to the tensor or any view of it bumps it, which is
    how ``regions.copy_to_tensor_parallel_region`` tells that a tensor it saw
    before is unchanged.
    Checked: torch 2.13.0.
    """
    return int(tensor._version)


def foreach_norm(tensors: list[torch.Tensor], p: float, dtype: torch.dtype) -> list[torch.Tensor]:
    """The ``p``-norm of each tensor, in ``dtype``, in one fused call (``torch._foreach_norm``).

    What ``torch.nn.utils.clip_grad_norm_`` uses for its per-device groups.
    Checked: torch 2.13.0.
    """
    return list(torch._foreach_norm(tensors, p, dtype=dtype))


def state_dict_metadata(state_dict: Any) -> dict[str, Any] | None:
    """The ``_metadata`` dict ``nn.Module.state_dict()`` attaches (kept by ``torch.save``).

    ``None`` for a plain mapping. Checked: torch 2.13.0, 2.14.1.
    """
    meta = getattr(state_dict, "_metadata", None)
    return meta if isinstance(meta, dict) else None
