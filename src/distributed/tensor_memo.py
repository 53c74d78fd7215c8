"""Remember, per process group, the last tensor an operator saw and a value for it.

Sibling layers fed one tensor (q/k/v, gate/up) can share work only if the
second one recognises the tensor the first one saw: the same object, not
modified in place since (same version counter). The tensor is held weakly,
so the memo keeps nothing of it alive and forgets it when it dies.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from . import _torch_compat
from .runtime import ProcessGroup

V = TypeVar("V")


class TensorMemo(Generic[V]):
    """Per group: the last tensor given to :meth:`put` (weakly), its version, and a value."""

    def __init__(self) -> None:
        self._entries: dict[ProcessGroup | None, tuple[weakref.ref[torch.Tensor], int, V]] = {}

    def put(self, group: ProcessGroup | None, tensor: torch.Tensor, value: V) -> None:
        """Remember ``value`` for ``tensor`` at its current version, replacing ``group``'s entry."""
        ref = weakref.ref(tensor, self._dropper(group))
        self._entries[group] = (ref, _torch_compat.version_counter(tensor), value)

    def get(self, group: ProcessGroup | None, tensor: torch.Tensor) -> V | None:
        """``group``'s value if its entry is ``tensor``, unmodified since :meth:`put`."""
        entry = self._entries.get(group)
        return None if entry is None else self._match(entry, tensor)

    def find(self, tensor: torch.Tensor) -> V | None:
        """The value of whichever group's entry is ``tensor``, unmodified since :meth:`put`."""
        for entry in self._entries.values():
            value = self._match(entry, tensor)
            if value is not None:
                return value
        return None

    def __len__(self) -> int:
        """Groups with a live entry."""
        return len(self._entries)

    def clear(self) -> None:
        """Forget every entry (the end of a forward)."""
        self._entries.clear()

    @staticmethod
    def _match(entry: tuple[weakref.ref[torch.Tensor], int, V], tensor: torch.Tensor) -> V | None:
        ref, version, value = entry
        if ref() is tensor and version == _torch_compat.version_counter(tensor):
            return value
        return None

    def _dropper(self, group: ProcessGroup | None) -> Callable[[weakref.ref[torch.Tensor]], None]:
        def drop(ref: weakref.ref[torch.Tensor]) -> None:
            entry = self._entries.get(group)
            if entry is not None and entry[0] is ref:
                del self._entries[group]
        return drop
