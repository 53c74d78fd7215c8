"""Remember a value for a tensor, recognised later only while it is unmodified.

Sibling layers fed one tensor (q/k/v, gate/up) can share work only if the
second one recognises the tensor the first one saw: the same object, not
modified in place since (same version counter). The tensor is held weakly,
so the memo keeps nothing of it alive and forgets it when it dies.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import torch

from ..core import torch_compat as _torch_compat
from .runtime import ProcessGroup

V = TypeVar("V")
# Whether any memo put an entry since the per-forward cleanup last ran
# (regions.forget_shared_inputs): read by the forward door without a call.
KEPT = False
_Entry = tuple["weakref.ref[torch.Tensor]", int, V]


class TensorMemo(Generic[V]):
    """Values remembered for tensors (held weakly) at the version they had.

    Args:
        last_per_group: Keep only the last tensor given per process group
            (for a value that references its tensor, which would otherwise
            live as long as the memo); otherwise one entry per live tensor.
    """

    def __init__(self, last_per_group: bool) -> None:
        self._last_per_group = last_per_group
        self._entries: dict[Hashable, _Entry[V]] = {}

    def put(self, group: ProcessGroup | None, tensor: torch.Tensor, value: V) -> None:
        """Remember ``value`` for ``tensor`` at its current version."""
        global KEPT
        KEPT = True
        key = self._key(group, tensor)
        ref = weakref.ref(tensor, self._dropper(key))
        self._entries[key] = (ref, _torch_compat.version_counter(tensor), value)

    def get(self, group: ProcessGroup | None, tensor: torch.Tensor) -> V | None:
        """The value remembered for ``tensor`` if it is unmodified since :meth:`put`."""
        entry = self._entries.get(self._key(group, tensor))
        if entry is None:
            return None
        ref, version, value = entry
        if ref() is tensor and version == _torch_compat.version_counter(tensor):
            return value
        return None

    def holds(self, group: ProcessGroup | None) -> bool:
        """Whether a live entry was put for ``group`` (``last_per_group`` memos)."""
        return id(group) in self._entries

    def __len__(self) -> int:
        """Live entries."""
        return len(self._entries)

    def clear(self) -> None:
        """Forget every entry."""
        self._entries.clear()

    def _key(self, group: ProcessGroup | None, tensor: torch.Tensor) -> Hashable:
        # By the group's id, not the group: the memo must not keep a group alive (a
        # reused id is harmless: the entry still has to hold this very tensor)
        return id(group) if self._last_per_group else id(tensor)

    def _dropper(self, key: Hashable) -> Callable[[weakref.ref[torch.Tensor]], None]:
        def drop(ref: weakref.ref[torch.Tensor]) -> None:
            entry = self._entries.get(key)
            if entry is not None and entry[0] is ref:
                del self._entries[key]
        return drop
