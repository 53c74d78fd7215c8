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
import torch.distributed.nn.functional  # imported up front: see the comment below
from torch import nn

# Imported with torchtp, before the script starts its process group. torch 2.13:
# ``torch.distributed.nn.functional`` evaluates ``group.WORLD`` in the default
# arguments of its functions when it is imported, so imported while a process group
# exists, its ten defaults keep that group alive past ``dist.destroy_process_group()``
# (C++ objects in tuples that the garbage collector does not track), to interpreter
# shutdown, where Gloo's worker can abort the process (decision 148). torch imports it
# lazily with dynamo (an optimizer's first step, a transformers model, torch.compile),
# FSDP and sharded tensors, usually after the script started its group. Imported
# before any group, the defaults are ``None``: the group current at the call, as
# torch means. It costs 9 small modules; dynamo itself stays lazy.
# Checked: torch 2.13.0 (decision 157).

CHECKED_TORCH = ("2.13.0", "2.14.1")

M = TypeVar("M", bound=nn.Module)
F = TypeVar("F", bound=Callable[..., Any])


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


def parameter_slots(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module``'s own parameter slots (``nn.Module._parameters``), the dict itself.

    A caller keeping it sees a later replacement of a parameter object (FSDP2's
    ``fully_shard`` writes new ones there) with one dict look-up.
    Checked: torch 2.13.0, 2.14.1.
    """
    slots: dict[str, nn.Parameter | None] = module.__dict__["_parameters"]
    return slots


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


def is_plain_add(node: Any) -> bool:
    """Whether autograd ``node`` records ``a + b`` (``torch.add`` with ``alpha`` 1, in place or not).

    Its gradient passes to both inputs unchanged. Checked: torch 2.13.0, 2.14.1
    (``AddBackward0``, ``_saved_alpha``).
    """
    return type(node).__name__ == "AddBackward0" and getattr(node, "_saved_alpha", 1) == 1


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
# Submodules replaced (``parent.child = module`` where ``parent`` had a ``child``) in this
# process since the hook below was installed: a changed count tells a wrapper, without a
# call, that a module of its model may have been replaced since it last looked (its FSDP2
# check, wrap/wrapper.py). First registrations are not counted: models build containers
# in their forward (an HF decoder slices its ModuleList of layers on every call).
REPLACEMENTS = 0


def on_module_registration(parent: nn.Module, name: str, child: Any) -> None:
    """The hook :func:`watch_ddp_construction` registers (cheap: one string compare).

    Also counts a replacement (:data:`REPLACEMENTS`): torch calls the hook before
    it writes ``parent._modules[name]``, so the old child is still there.
    Checked: torch 2.13.0, 2.14.1.
    """
    if name in parent.__dict__["_modules"]:
        global REPLACEMENTS
        REPLACEMENTS += 1
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


def _active_ddp() -> Callable[[], Any]:
    return _ddp_class()._get_active_ddp_module  # type: ignore[attr-defined]


# active_ddp(): the ``DistributedDataParallel`` whose forward is running its module now,
# else ``None`` (``DistributedDataParallel._get_active_ddp_module``: DDP sets it around
# ``self.module(...)`` in its forward, not with the Python reducer). torch's own
# classmethod, not a wrapper: the forward door asks before every forward.
# Checked: torch 2.13.0, 2.14.1.
active_ddp: Callable[[], Any] = _active_ddp()


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


def eager_when_compiled(fn: F) -> F:
    """``fn`` as is, except that inside ``torch.compile`` it runs eagerly (never traced).

    What ``@torch.compiler.disable`` does, without importing dynamo when the
    decorated module is imported: ``torch.compiler.disable`` imports
    ``torch._dynamo`` (and sympy with it), about 1 s of every ``import torchtp``
    and 0.3 s of every process exit spent tearing those modules down, for
    users who never compile. Under tracing (dynamo is loaded by then) each call
    disables ``fn`` afresh: no state changes between traces, so nothing
    recompiles (a cached disabled function would: dynamo guards on the cache),
    and the trace graph-breaks twice, at the ``disable`` call and at the call
    of what it returns.
    Checked: torch 2.13.0.
    """

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        return torch.compiler.disable(fn)(*args, **kwargs)

    return call  # type: ignore[return-value]


def is_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view of another tensor (it has a ``_base``).

    An autograd.Function output that is a view cannot be modified in place later.
    Checked: torch 2.13.0.
    """
    return tensor._base is not None


def hold_mesh_groups_weakly(mesh: Any) -> None:
    """Make ``mesh`` (a ``DeviceMesh`` torchtp built) hold its process groups weakly.

    Since torch 2.13 a ``DeviceMesh`` keeps its groups in ``_pg_registry`` (a
    dict, for ``torch.compile``'s look-ups), so a mesh alive after
    ``dist.destroy_process_group()`` keeps every group alive until the
    interpreter shuts down, where Gloo's workers may abort the process
    (:mod:`torchtp.comm.group_ref`). A weak-valued registry answers the same
    look-ups while the groups live. Meshes without the registry (torch before
    2.13) hold group names only: nothing to do.
    Checked: torch 2.13.0.
    """
    import weakref

    registry = getattr(mesh, "_pg_registry", None)
    if isinstance(registry, dict):
        mesh._pg_registry = weakref.WeakValueDictionary(registry)


def at_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward pass now running completes without an error.

    Only valid while autograd runs a backward (e.g. from a node hook). The
    engine runs queued callbacks after the whole graph task succeeded and
    drops them when the backward raised, which is what lets torchtp notice a
    backward that failed on one rank (see :mod:`torchtp.comm.health`).
    Checked: torch 2.13.0.
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def backward_node() -> Any:
    """The autograd node this thread's backward pass is running, or None outside one.

    During activation checkpointing's recomputation, the node that asked for it:
    one object per recomputed segment (torch keeps it while the node lives).
    Checked: torch 2.13.0.
    """
    return torch._C._current_autograd_node()


# The id of the autograd graph task this thread runs, -1 outside any backward: the C
# function itself, not a wrapper, for the check on every training forward
# (torchtp.layers.rng.enter_model). Checked: torch 2.13.0.
graph_task_id: Callable[[], int] = torch._C._current_graph_task_id


def in_backward() -> bool:
    """Whether this thread is running inside an autograd backward pass (e.g. a recompute).

    Checked: torch 2.13.0.
    """
    return bool(graph_task_id() != -1)


# use_count(tensor): how many C++ references the tensor's implementation has (the Python
# object is one). A collective's work object holds references to its tensors until it is
# destroyed, so a drop tells that the backend has let go of the work. The tensor method
# itself, not a wrapper: it runs on every collective. Checked: torch 2.13.0.
use_count: Callable[[torch.Tensor], int] = torch.Tensor._use_count  # type: ignore[attr-defined]


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


def grad_scaler_state(scaler: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A ``torch.amp.GradScaler``'s state for ``optimizer``: its ``"stage"`` (an
    ``OptState``) and ``"found_inf_per_device"`` (``{device: 0-dim float tensor}``, set by
    ``unscale_``), which ``step`` reads to skip ``optimizer.step()`` and ``update`` to
    lower the scale. Checked: torch 2.13.0, 2.14.1 (``_per_optimizer_states``).
    """
    return scaler._per_optimizer_states[id(optimizer)]


def state_dict_metadata(state_dict: Any) -> dict[str, Any] | None:
    """The ``_metadata`` dict ``nn.Module.state_dict()`` attaches (kept by ``torch.save``).

    ``None`` for a plain mapping. Checked: torch 2.13.0, 2.14.1.
    """
    meta = getattr(state_dict, "_metadata", None)
    return meta if isinstance(meta, dict) else None


# The symmetric-memory fused ops (torch.ops.symm_mem.*) exist from torch 2.6 with the
# signatures used below; torchtp checked them against CHECKED_TORCH (API only: no GPU).
SYMM_MEM_SINCE = (2, 6)


def symm_mem_gate(device_type: str, backend: str, version: tuple[int, int],
                  autocast: bool, has_ops: bool) -> str | None:
    """Why PyTorch's symmetric-memory fused ops cannot run, or ``None`` when they can.

    The pure decision behind :func:`symm_mem_unavailable` (tested on its own).

    Args:
        device_type: The tensors' device type.
        backend: The process group's backend name.
        version: torch's ``(major, minor)``.
        autocast: Autocast is on for the device (the fused op would gather the
            cast input, not the one the layer saw).
        has_ops: ``torch.ops.symm_mem`` has both fused ops.

    Checked: torch 2.13.0 (the ops' schemas; the ops were not run, no GPU).
    """
    if device_type != "cuda":
        return f"the tensors are on {device_type}, the fused ops need CUDA"
    if backend != "nccl":
        return f"the group's backend is {backend}, the fused ops need NCCL"
    if version < SYMM_MEM_SINCE:
        return (f"torch {version[0]}.{version[1]} predates the fused ops "
                f"(torch >= {SYMM_MEM_SINCE[0]}.{SYMM_MEM_SINCE[1]})")
    if autocast:
        return "autocast is on (the fused all-gather would gather the cast input)"
    if not has_ops:
        return "torch.distributed._symmetric_memory did not register the fused ops"
    return None


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


@functools.cache
def _symm_mem_ops() -> bool:
    """Import ``torch.distributed._symmetric_memory`` (it registers ``torch.ops.symm_mem``)."""
    try:
        import torch.distributed._symmetric_memory
    except ImportError:
        return False
    ops = getattr(torch.ops, "symm_mem", None)
    return ops is not None and all(hasattr(ops, n) for n in (
        "fused_all_gather_matmul", "fused_matmul_reduce_scatter"))


def symm_mem_unavailable(tensor: torch.Tensor, group: Any) -> str | None:
    """Why the fused ops cannot run for ``tensor`` on ``group``, or ``None`` when they can.

    Checked: torch 2.13.0 (the gate; the ops themselves were not run, no GPU).
    """
    import torch.distributed as dist

    device = tensor.device.type
    if device != "cuda":  # the common CPU case without importing anything
        return symm_mem_gate(device, "", (0, 0), False, False)
    return symm_mem_gate(device, str(dist.get_backend(group)), _torch_version(),
                         torch.is_autocast_enabled(device), _symm_mem_ops())


def fused_all_gather_matmul(shard: torch.Tensor, mats: list[torch.Tensor], dim: int,
                            group: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``torch.ops.symm_mem.fused_all_gather_matmul``: gather ``shard`` along ``dim``, multiply.

    Returns the gathered tensor and ``gathered @ m`` for each matrix ``m``
    ``(d, out)``. Call only when :func:`symm_mem_unavailable` returned ``None``.
    Checked: torch 2.13.0 (signature only; not run, no GPU).
    """
    full, outs = torch.ops.symm_mem.fused_all_gather_matmul(
        shard, mats, dim, group.group_name, return_A=True)
    return full, list(outs)


def fused_matmul_reduce_scatter(x: torch.Tensor, mat: torch.Tensor, dim: int,
                                group: Any) -> torch.Tensor:
    """``torch.ops.symm_mem.fused_matmul_reduce_scatter``: ``x @ mat`` summed, scattered on ``dim``.

    ``x`` ``(B, L, d)`` with ``L`` a multiple of the group size; returns this
    rank's ``(B, L / tp, out)``. Call only when :func:`symm_mem_unavailable`
    returned ``None``. Checked: torch 2.13.0 (signature only; not run, no GPU).
    """
    out: torch.Tensor = torch.ops.symm_mem.fused_matmul_reduce_scatter(
        x, mat, "sum", dim, group.group_name)
    return out


def zeroed_shape_inference(stage_cls: type) -> type:
    """``stage_cls`` (a subclass of torch's ``PipelineStage``) whose shape inference feeds zeros.

    torch infers the shapes a stage sends by running it once on tensors
    materialized from metadata (``PipelineStage._to_tensor``), which are
    uninitialized memory: the tensor-parallel ranks of one stage then compute
    from different garbage, and an MoE router routes their tokens to
    different experts (torchtp's route check raises). Zeros make every rank
    of a stage compute the same values; shapes do not depend on them.
    A release without ``_to_tensor`` gets ``stage_cls`` unchanged.
    Checked: torch 2.13.0.
    """
    if not hasattr(stage_cls, "_to_tensor"):
        return stage_cls

    class Zeroed(stage_cls):
        def _to_tensor(self, arg: Any) -> torch.Tensor:
            out = super()._to_tensor(arg)
            if not isinstance(arg, torch.Tensor):  # materialized from metadata
                with torch.no_grad():
                    out.zero_()
            return out

    Zeroed.__name__ = Zeroed.__qualname__ = stage_cls.__name__
    return Zeroed
