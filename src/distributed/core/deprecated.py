"""Old spellings kept for one release: resolve them with a ``DeprecationWarning``.

A package lists its old names as ``{old: (module, attribute, replacement)}`` and
calls :func:`resolve` from its module ``__getattr__``, so the old name is
neither in ``__all__`` nor bound in the package (``from pkg import *`` and
``dir()`` show one spelling; docs/api.md lists both).
"""

from __future__ import annotations

import importlib
import warnings

Moved = dict[str, tuple[str, str, str]]


def resolve(package: str, name: str, moved: Moved) -> object:
    """Return the object behind the deprecated ``package.name``, warning once per call site.

    Args:
        package: The importing package's ``__name__`` (``"torchtp"``...).
        name: The attribute asked for.
        moved: ``{old name: (module relative to package or absolute, attribute, replacement)}``.

    Raises:
        AttributeError: ``name`` is neither a deprecated spelling nor defined.
    """
    if name not in moved:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    module, attribute, replacement = moved[name]
    warnings.warn(f"{package}.{name} is deprecated and will be removed in the next release; "
                  f"use {replacement}", DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(module, package), attribute)
