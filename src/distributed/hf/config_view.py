"""A per-module copy of a shared HF config with local head counts.

Attention modules that read ``self.config.num_attention_heads`` (Phi-3's
fused-qkv split, and many others) in their forward need their rank's head
count, while the model's shared config keeps the full one. The module gets a
real config object of the same class: a shallow copy of the shared config
with the local values written in. Plain attribute reads on it are what
``torch.compile`` traces without graph breaks (a ``__getattr__`` proxy is not).

A few attributes stay *live*: they are properties of a per-class subclass
that read and write the shared config, so switching the attention
implementation after wrapping (``model.set_attn_implementation("sdpa")``
writes ``_attn_implementation_internal`` on the shared config) reaches every
attention module. Other writes to the shared config after wrapping are not
seen by the copies (docs/decisions.md).
"""

from __future__ import annotations

from typing import Any

from .compat import CONFIG_IMPLEMENTATION_ATTRS

# Attributes read live from the shared config: the implementation switches.
LIVE_ATTRS = CONFIG_IMPLEMENTATION_ATTRS
_SHARED = "_torchtp_shared_config"
_CLASSES: dict[type, type] = {}


def local_config(shared: Any, overrides: dict[str, Any]) -> Any:
    """A copy of ``shared`` (same class, as a subclass) with ``overrides`` set.

    Args:
        shared: The model's config (a ``transformers`` config object).
        overrides: ``{attribute: local value}``, e.g. ``{"num_attention_heads": 4}``.

    Returns:
        A config that reads like ``shared`` except for ``overrides``; the
        attributes in :data:`LIVE_ATTRS` are read from and written to ``shared``.
    """
    if is_local_config(shared):
        shared = shared.__dict__[_SHARED]
    cls: Any = _local_class(type(shared))
    local = cls.__new__(cls)
    state = {k: v for k, v in shared.__dict__.items() if k not in LIVE_ATTRS}
    local.__dict__.update(state)
    local.__dict__[_SHARED] = shared
    for name, value in overrides.items():
        setattr(local, name, value)  # through the config's attribute_map (n_head -> ...)
    return local


def is_local_config(config: object) -> bool:
    """True for a config made by :func:`local_config`."""
    return _SHARED in getattr(config, "__dict__", {})


def _local_class(base: type) -> type:
    """``base`` with the live attributes turned into properties on the shared config."""
    cls = _CLASSES.get(base)
    if cls is None:
        namespace: dict[str, Any] = {name: _live(name) for name in LIVE_ATTRS}
        namespace["__reduce__"] = _reduce
        namespace["to_dict"] = _to_dict
        namespace["__module__"] = base.__module__
        namespace["__qualname__"] = base.__qualname__
        cls = type(base.__name__, (base,), namespace)
        _CLASSES[base] = cls
    return cls


def _live(name: str) -> property:
    def get(self: Any) -> Any:
        return getattr(self.__dict__[_SHARED], name, None)

    def put(self: Any, value: Any) -> None:
        setattr(self.__dict__[_SHARED], name, value)

    return property(get, put, doc=f"``{name}`` of the shared config (live).")


def _to_dict(self: Any) -> dict[str, Any]:
    # The link to the shared config is no config value: keep it out of dumps and reprs.
    base: Any = type(self).__mro__[1]
    out: dict[str, Any] = base.to_dict(self)
    out.pop(_SHARED, None)
    return out


def _reduce(self: Any) -> tuple[Any, tuple[Any, dict[str, Any]]]:
    # Copies and pickles rebuild from the shared config plus what differs from it.
    shared = self.__dict__[_SHARED]
    own = {k: v for k, v in self.__dict__.items()
           if k != _SHARED and shared.__dict__.get(k, _MISSING) is not v}
    return _rebuild, (shared, own)


def _rebuild(shared: Any, own: dict[str, Any]) -> Any:
    local = local_config(shared, {})
    local.__dict__.update(own)
    return local


_MISSING = object()
