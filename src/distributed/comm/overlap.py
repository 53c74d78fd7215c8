"""When torchtp overlaps communication with computation: the switch and its defaults.

Two overlaps, each exact (same values as without it, up to the rounding of a
matrix product split into row blocks, see docs/performance.md):

``"grad_reduce"``
    The backward of the weight-rows-split projections (``RowParallelLinear``)
    starts the all-reduce of the input gradient without waiting, computes the
    weight and bias gradients meanwhile, then waits (Megatron's asynchronous
    gradient all-reduce). Under sequence parallelism the same backward starts
    the all-gather of the saved input shard before it computes the input
    gradient. The collectives issued are the same as without overlap.
``"sequence"``
    Under sequence parallelism, the all-gather entering each attention/MLP
    block and the reduce-scatter leaving it are cut into chunks along the
    sequence, each chunk's collective running beside the matrix product of
    the previous one (all-gather + matmul, matmul + reduce-scatter; the
    backward of the weight-columns-split projection too). On CUDA with NCCL
    PyTorch's symmetric-memory fused ops do this where available
    (:func:`torchtp.core.torch_compat.fused_all_gather_matmul`). More
    collectives per step (one per chunk).

Who decides, first match wins: the layer's ``overlap`` attribute (set by
``DistributedModelWrapper(overlap=...)``: ``True``/``False`` for both
overlaps), else the ``TP_OVERLAP`` environment variable (``1``/``on``,
``0``/``off``, or a comma list of the overlaps to turn on, e.g.
``grad_reduce``), else :data:`AUTO`, per overlap and device type, chosen from
measurements (docs/performance.md). Every rank of a group must decide alike:
the chunked collectives differ in number from the plain ones, and the
wrapper agrees on the setting before it cuts anything.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

from ..core.env import env_int
from ..core.log import debug_enabled, logger

ENV = "TP_OVERLAP"
CHUNKS_ENV = "TP_OVERLAP_CHUNKS"
Kind = Literal["grad_reduce", "sequence"]
KINDS: tuple[Kind, ...] = ("grad_reduce", "sequence")

# The default per (overlap, device type), from benchmarks/overlap.py (docs/benchmarks.md).
# CPU/Gloo: measured here. CUDA/NCCL: not measured by this project (no GPU was lent);
# the asynchronous gradient all-reduce issues no extra collective and is Megatron's
# default, the chunked sequence-parallel path adds collectives and stays off until measured.
AUTO: dict[tuple[Kind, str], bool] = {
    ("grad_reduce", "cpu"): True,
    ("grad_reduce", "cuda"): True,
    ("sequence", "cpu"): False,
    ("sequence", "cuda"): False,
}
DEFAULT_CHUNKS = 2  # chunks per sequence shard on the chunked path

_ON = {"1", "true", "yes", "on", "all"}
_OFF = {"0", "false", "no", "off", "none"}
_ENV_CACHE: list[frozenset[str] | None] = []  # [parsed TP_OVERLAP] once read


def env_setting() -> frozenset[str] | None:
    """The overlaps ``TP_OVERLAP`` turns on (``None``: unset, the defaults apply).

    Read once per process (forwards are hot); :func:`reset` reads it again.

    Raises:
        ValueError: a value that is neither on, off nor a list of overlap names.
    """
    if not _ENV_CACHE:
        _ENV_CACHE.append(_parse(os.environ.get(ENV, "")))
    return _ENV_CACHE[0]


def _parse(raw: str) -> frozenset[str] | None:
    value = raw.strip().lower()
    if not value or value == "auto":
        return None
    if value in _ON:
        return frozenset(KINDS)
    if value in _OFF:
        return frozenset()
    names = frozenset(v.strip() for v in value.split(",") if v.strip())
    unknown = sorted(names - set(KINDS))
    if unknown:
        raise ValueError(f"{ENV}={raw!r}: {unknown} name no overlap; use 1/on, 0/off, auto, "
                         f"or a comma list of {list(KINDS)}")
    return names


def chunks() -> int:
    """Chunks per sequence shard on the chunked path (``TP_OVERLAP_CHUNKS``, default 2).

    Raises:
        ValueError: not an integer >= 1.
    """
    return env_int(CHUNKS_ENV, DEFAULT_CHUNKS, 1, "chunks per sequence shard; 1 issues one "
                   "collective per chunk of the whole shard")


def reset() -> None:
    """Forget the cached ``TP_OVERLAP`` (tests that change it in-process)."""
    _ENV_CACHE.clear()


def enabled(kind: Kind, setting: bool | None, device: torch.device) -> bool:
    """Whether overlap ``kind`` runs for a layer whose ``overlap`` attribute is ``setting``.

    Args:
        kind: ``"grad_reduce"`` or ``"sequence"``.
        setting: The layer's explicit choice (``None``: not chosen).
        device: Where the layer computes (the input's device).
    """
    if setting is not None:
        return setting
    env = env_setting()
    if env is not None:
        return kind in env
    return AUTO.get((kind, device.type), False)


def describe(setting: bool | None) -> str:
    """One line for logs and rank agreement: the setting and where it came from."""
    if setting is not None:
        return f"overlap={setting} (explicit)"
    env = env_setting()
    if env is not None:
        return f"{ENV}={sorted(env)}"
    return "auto (" + ", ".join(f"{k}/{d}={v}" for (k, d), v in AUTO.items()) + ")"


_LOGGED: set[tuple[str, str]] = set()


def log_fallback(what: str, reason: str) -> None:
    """Say under ``TP_DEBUG`` (once per process and reason) that a fused path was not
    taken and the exact chunked fallback runs instead."""
    if (what, reason) not in _LOGGED and debug_enabled():
        _LOGGED.add((what, reason))
        logger.debug("overlap: %s runs the exact chunked fallback, not PyTorch's fused "
                     "symmetric-memory op: %s", what, reason)
