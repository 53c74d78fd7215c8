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
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from types import FrameType
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


def ddp_under_construction(depth: int = 2) -> Any:
    """The ``DistributedDataParallel`` whose ``__init__`` is ``depth`` frames up, else ``None``.

    ``DistributedDataParallel.__init__`` sets ``self.process_group``, then reads
    ``module._ddp_params_and_buffers_to_ignore`` and leaves those parameters
    out of its start-up broadcast and gradient averaging; a module answering
    that query through a property calls this to learn DDP's process group.
    Checked: torch 2.13.0.
    """
    from torch.nn.parallel import DistributedDataParallel

    caller = sys._getframe(depth).f_locals.get("self")
    return caller if isinstance(caller, DistributedDataParallel) else None


def enclosing_ddps(limit: int = 64) -> list[Any]:
    """The ``DistributedDataParallel`` modules whose ``forward`` is on this thread's stack.

    Walks at most ``limit`` frames up (``sys._getframe``), reading each
    frame's ``self``.
    Checked: torch 2.13.0.
    """
    from torch.nn.parallel import DistributedDataParallel

    found: list[Any] = []
    frame: FrameType | None = sys._getframe(1)
    for _ in range(limit):
        if frame is None:
            break
        caller = frame.f_locals.get("self")
        if isinstance(caller, DistributedDataParallel) and caller not in found:
            found.append(caller)
        frame = frame.f_back
    return found


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
    backward that failed on one rank (see :mod:`torchtp._health`).
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
