"""Process groups held weakly: nothing of torchtp's outlives the group it used.

torch frees a process group (joins Gloo's worker threads, ends NCCL's
communicators) when the last reference to it goes. ``dist.destroy_process_group()``
drops torch's own references, so the group ends right there, with the
interpreter whole, unless something else still holds it. Anything of torchtp's
that did (a layer, a hook, the autograd node of an output the script kept,
torchtp's per-group state) kept it until the interpreter shut down, and a
Gloo worker that then freed a finished collective's tensor had to take the
GIL of a finalizing interpreter: the process aborted with "terminate called
without an active exception" after all its work was done (docs/decisions.md,
decision 148).

So torchtp never owns a group: every object that keeps one past a call
stores it through :class:`GroupRef` (autograd nodes, closures) or a
:class:`WeakGroup` attribute (layers, hooks, configs, states). Reading it
returns the group, ``None`` (a single process: nothing to communicate), or
raises :class:`~torchtp.core.errors.GroupDestroyedError` naming the holder;
a destroyed group is never mistaken for a single process.
"""

from __future__ import annotations

import weakref
from typing import Any, Generic, TypeVar, overload

import torch.distributed as dist

from ..core.errors import GroupDestroyedError

ProcessGroup = dist.ProcessGroup
G = TypeVar("G", bound="ProcessGroup | None")  # ProcessGroup, or ProcessGroup | None


def destroyed(holder: str) -> GroupDestroyedError:
    """The error for ``holder`` using a group that was destroyed."""
    return GroupDestroyedError(
        f"{holder} used a process group that was destroyed (dist.destroy_process_group() or "
        "torchtp.shutdown_tensor_parallel()); torchtp holds groups weakly so that a destroyed "
        "group is freed at once: start a new group and build or wrap the model again")


class GroupRef:
    """One process group, held weakly; call it to get the group.

    Args:
        group: The group, or ``None`` for a single process.
        holder: What holds it, for the error; by default an autograd node.
    """

    __slots__ = ("_holder", "_ref")

    def __init__(self, group: ProcessGroup | None,
                 holder: str = "the backward of a torchtp collective") -> None:
        self._ref = None if group is None else weakref.ref(group)
        self._holder = holder

    def __call__(self) -> ProcessGroup | None:
        """The group (``None``: a single process).

        Raises:
            GroupDestroyedError: the group was destroyed.
        """
        if self._ref is None:
            return None
        group = self._ref()
        if group is None:
            raise destroyed(self._holder)
        return group

    @property
    def alive(self) -> bool:
        """False once the group was destroyed (``None`` stays alive)."""
        return self._ref is None or self._ref() is not None


class WeakGroup(Generic[G]):
    """A class attribute that stores a process group weakly.

    ``obj.group = g`` keeps a weak reference; ``obj.group`` returns ``g``,
    ``None`` (a single process), or raises :class:`GroupDestroyedError` naming
    ``obj`` once ``g`` was destroyed. Works on ``nn.Module`` subclasses and on
    (frozen) dataclasses, where it is a field defaulting to ``None``
    (``required=True``: a field without a default). Annotate it
    ``WeakGroup[ProcessGroup | None]``, or ``WeakGroup[ProcessGroup]`` where a
    group is always set.
    """

    def __init__(self, required: bool = False) -> None:
        self._required = required
        self._slot = ""
        self._name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._slot, self._name = slot(name), name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> None: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> G: ...

    def __get__(self, obj: object | None, owner: type | None = None) -> G | None:
        if obj is None:  # class access: the dataclass default
            if self._required:
                raise AttributeError(self._name)
            return None
        try:
            ref = obj.__dict__[self._slot]
        except KeyError:
            raise AttributeError(f"{type(obj).__name__} has no {self._name} yet") from None
        if ref is None:
            return None
        group: G | None = ref()
        if group is None:
            raise destroyed(f"{_describe(obj)}'s {self._name}")
        return group

    def __set__(self, obj: object, group: G) -> None:
        obj.__dict__[self._slot] = None if group is None else weakref.ref(group)

    def alive(self, obj: object) -> bool:
        """Whether ``obj``'s group is unset, ``None`` or not destroyed (never raises)."""
        ref = obj.__dict__.get(self._slot)
        return ref is None or ref() is not None


def slot(name: str) -> str:
    """Where a :class:`WeakGroup` attribute ``name`` keeps its weak reference (``None`` for
    a single process) in the instance's ``__dict__``: a hot path reads it without a call,
    ``ref = obj.__dict__[slot("group")]``, and reads the attribute itself (which raises,
    naming ``obj``) only when ``ref()`` is dead."""
    return f"_{name}_ref"


def groups_alive(obj: object) -> bool:
    """Whether no group ``obj`` holds through a :class:`WeakGroup` was destroyed (never raises)."""
    return all(attr.alive(obj) for klass in type(obj).__mro__ for attr in vars(klass).values()
               if isinstance(attr, WeakGroup))


def _describe(obj: Any) -> str:
    """The holder named in the error: a parallel layer's own description, else its class."""
    name = getattr(type(obj), "_name", None)
    return str(name(obj)) if callable(name) else type(obj).__name__
