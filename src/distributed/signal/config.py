"""Named signal configs: ``SignalConfig``/``ShardConfig``, the registry and YAML loading.

YAML schema (the document's)::

    forward_layer1:
      shard:
        axis: 0                  # tensor dim to shard
        workers: [0, 1, 2, 3]    # ranks holding the shards
      backward: backward_layer1  # optional: signal for gradients
      compile: true              # optional: torch.compile modules parallelized under it
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class ShardConfig:
    """Shard tensors along ``axis`` over ranks ``workers`` (``None``: the whole world)."""

    axis: int = 0
    workers: tuple[int, ...] | None = None

    def __init__(self, axis: int = 0, workers: Sequence[int] | None = None):
        if isinstance(axis, bool) or not isinstance(axis, int) or axis < 0:
            raise ValueError(f"ShardConfig.axis={axis!r} must be an int >= 0")
        if workers is not None:
            if isinstance(workers, (str, bytes)) or not all(
                    isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in workers):
                raise ValueError(f"ShardConfig.workers={workers!r} must be a list of ranks >= 0")
            if not workers or len(set(workers)) != len(workers):
                raise ValueError(f"ShardConfig.workers={list(workers)} must be non-empty with "
                                 "no repeated rank")
            # A set of ranks: shards go to them in increasing rank order (DTensor's order
            # on a mesh dimension), however they are listed
            workers = tuple(sorted(workers))
        object.__setattr__(self, "axis", axis)
        object.__setattr__(self, "workers", workers)


@dataclass(frozen=True)
class SignalConfig:
    """What a named signal does.

    Attributes:
        shard: How tensors are sharded (``None``: factories return plain tensors).
        backward_signal: Signal whose config applies to gradients.
        compile: Apply ``torch.compile`` to modules parallelized under this signal.
        source: Where it came from (``"config.yaml: name"``), for error messages.
    """

    shard: ShardConfig | None = None
    backward_signal: str | None = None
    compile: bool = False
    source: str = field(default="python", compare=False)


_REGISTRY: dict[str, SignalConfig] = {}


def register_config(name: str, config: SignalConfig) -> None:
    """Register (or replace) the signal ``name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"signal name {name!r} must be a non-empty string")
    if not isinstance(config, SignalConfig):
        raise TypeError(f"register_config({name!r}, ...) needs a SignalConfig, got "
                        f"{type(config).__name__}")
    _REGISTRY[name] = config


def unregister_config(name: str) -> None:
    """Forget the signal ``name`` (no error when unknown)."""
    _REGISTRY.pop(name, None)


def get_config(name: str) -> SignalConfig:
    """The config of signal ``name``.

    Raises:
        KeyError: no such signal; the message lists the known ones.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY)) or "none registered"
        raise KeyError(f"unknown signal {name!r}; known signals: {known}. Register it with "
                       "torchtp.signal.register_config or load a YAML file") from None


def list_configs() -> dict[str, SignalConfig]:
    """A copy of the registry."""
    return dict(_REGISTRY)


def load_config(path: str | Path) -> dict[str, SignalConfig]:
    """Load every signal of a YAML file into the registry (all or nothing).

    Returns:
        The signals the file defined.

    Raises:
        FileNotFoundError: no such file.
        ValueError: malformed YAML or a bad key; the message names the file and key.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"signal config file {str(path)!r} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML: {err}") from None
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"{path}: the top level must map signal names to configs, got "
                         f"{type(raw).__name__}")
    parsed = {str(name): _parse(path, str(name), body) for name, body in raw.items()}
    for name, cfg in parsed.items():
        target = cfg.backward_signal
        if target is not None and target not in parsed and target not in _REGISTRY:
            raise ValueError(f"{path}: {name}.backward: unknown signal {target!r}; define it "
                             "in this file or register it first")
    _REGISTRY.update(parsed)
    return parsed


_KEYS = ("shard", "backward", "backward_signal", "compile")


def _parse(path: Path, name: str, body: Any) -> SignalConfig:
    where = f"{path}: {name}"
    if not isinstance(body, Mapping):
        raise ValueError(f"{where}: expected a mapping with keys shard/backward/compile, got "
                         f"{body!r}")
    for key in body:
        if key not in _KEYS:
            raise ValueError(f"{where}.{key}: unknown key; expected one of shard, backward, "
                             "compile")
    backward = body.get("backward", body.get("backward_signal"))
    if backward is not None and not isinstance(backward, str):
        raise ValueError(f"{where}.backward: expected a signal name, got {backward!r}")
    compile_ = body.get("compile", False)
    if not isinstance(compile_, bool):
        raise ValueError(f"{where}.compile: expected true or false, got {compile_!r}")
    return SignalConfig(_parse_shard(where, body.get("shard")), backward, compile_, where)


def _parse_shard(where: str, shard: Any) -> ShardConfig | None:
    if shard is None:
        return None
    if not isinstance(shard, Mapping):
        raise ValueError(f"{where}.shard: expected a mapping with axis and workers, got "
                         f"{shard!r}")
    for key in shard:
        if key not in ("axis", "workers"):
            raise ValueError(f"{where}.shard.{key}: unknown key; expected axis, workers")
    axis, workers = shard.get("axis", 0), shard.get("workers")
    if isinstance(axis, bool) or not isinstance(axis, int) or axis < 0:
        raise ValueError(f"{where}.shard.axis: expected an int >= 0, got {axis!r}")
    if workers is not None and (not isinstance(workers, list) or not workers or not all(
            isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in workers)
            or len(set(workers)) != len(workers)):
        raise ValueError(f"{where}.shard.workers: expected a non-empty list of distinct ranks "
                         f">= 0, got {workers!r}")
    return ShardConfig(axis, workers)
