"""What the wrapper sets up for the frameworks users train with (see docs/integrations.md).

A wrap must not import a framework it may never meet: importing accelerate
costs about 50 modules (and their teardown at every exit), PEFT more. So a
framework's hooks (PEFT's layer registration, accelerate's DDP refusal) are
installed at the wrap only when the framework is already imported; otherwise
one finder on ``sys.meta_path`` per framework (:func:`after_import`) lets the
other finders find it, runs the framework's own import, then the hook, and
removes itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

from . import accelerate_clip, ddp_refusal
from .hf_model import guard_hf_model


def guard_frameworks(wrapper: Any) -> None:
    """HF model methods on the wrapped model; accelerate's and Lightning's DDP refused and
    accelerate's clipping routed when tp > 1."""
    guard_hf_model(wrapper)
    if wrapper.world_size > 1:  # accelerate imported later is refused (and routed) too
        after_import("accelerate", _accelerate_hooks)
    if wrapper.world_size > 1 and "lightning" in sys.modules:
        ddp_refusal.install_lightning()  # a LightningModule wrapping its model in __init__


def _accelerate_hooks() -> None:
    """accelerate's DDP refused, its clipping routed: one hook (one watcher per name)."""
    ddp_refusal.install()
    accelerate_clip.install()


def after_import(name: str, hook: Callable[[], Any]) -> None:
    """Call ``hook`` now if module ``name`` is imported, else right after its import.

    Installed once per name (a second call before the import adds nothing);
    nothing is imported or changed before the user imports ``name``.
    """
    if name in sys.modules:
        hook()
        return
    if not any(isinstance(f, _Watch) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _Watch(name, hook))


class _Watch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: lets the other finders find ``name`` and wraps its loader."""

    def __init__(self, name: str, hook: Callable[[], Any]) -> None:
        self.name, self.hook = name, hook

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once: the other finders find the module itself
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _HookAfter(spec.loader, self.hook)
        return spec


class _HookAfter(importlib.abc.Loader):
    """The module's own loader, then torchtp's hook."""

    def __init__(self, loader: Any, hook: Callable[[], Any]) -> None:
        self.loader, self.hook = loader, hook

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        self.hook()

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self.loader, name)
