"""torchtp.signal: named sharding configs ("signals") from Python or YAML.

``TORCHTP_CONFIG=path.yaml`` is loaded when this package is first imported.
Use ``torchtp.signal.context(name)`` (or ``enter``/``exit``) to make the
factories ``randn``/``zeros``/``ones`` return tensors sharded on the
signal's workers, ``tensor(x, name)`` to copy-shard a tensor and
``parallelize(module)`` to replicate (and, with ``compile: true``, compile) a module.

Layer 3, a seed-document core beside ``plans``. May import: ``core``, ``comm``,
``shard``.
"""

from __future__ import annotations

import os

from .config import (
    ShardConfig,
    SignalConfig,
    get_config,
    list_configs,
    load_config,
    register_config,
    unregister_config,
)
from .scope import context, current, enter, exit, grid_for, ones, parallelize, randn, tensor, zeros

ENV_VAR = "TORCHTP_CONFIG"


def _load_from_env() -> None:
    path = os.environ.get(ENV_VAR)
    if not path:
        return
    try:
        load_config(path)
    except (OSError, ValueError) as err:
        raise type(err)(f"{ENV_VAR}={path!r}: {err}") from None


_load_from_env()

__all__ = [
    "ENV_VAR",
    "ShardConfig",
    "SignalConfig",
    "context",
    "current",
    "enter",
    "exit",
    "get_config",
    "grid_for",
    "list_configs",
    "load_config",
    "ones",
    "parallelize",
    "randn",
    "register_config",
    "tensor",
    "unregister_config",
    "zeros",
]
