"""How long torchtp waits for other ranks: one setting, read by the runtime and the health checks."""

from __future__ import annotations

import os

DEFAULT_TIMEOUT_S = 300.0
"""Collective timeout of the groups torchtp starts, in seconds (5 minutes).

Long enough for ranks that load large checkpoints at different speeds, short
enough that a rank stuck or gone is reported in minutes rather than after
torch's 30. Change it with ``init_tensor_parallel(timeout=...)`` or the
``TP_TIMEOUT`` environment variable (seconds); the explicit argument wins.
"""

_TIMEOUT_S: float | None = None  # set by init_tensor_parallel(timeout=...)


def set_collective_timeout(seconds: float) -> None:
    """Use ``seconds`` from now on (``init_tensor_parallel(timeout=...)``)."""
    global _TIMEOUT_S
    _TIMEOUT_S = seconds


def collective_timeout() -> float:
    """Seconds torchtp waits for other ranks before it reports them stuck.

    The ``timeout`` given to :func:`~torchtp.init_tensor_parallel`, else
    ``TP_TIMEOUT``, else :data:`DEFAULT_TIMEOUT_S`. It is also the
    process-group timeout of the groups torchtp starts.

    Raises:
        ValueError: ``TP_TIMEOUT`` is not a positive number.
    """
    if _TIMEOUT_S is not None:
        return _TIMEOUT_S
    value = os.environ.get("TP_TIMEOUT", "").strip()
    if not value:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ValueError(f"TP_TIMEOUT={value!r} must be a positive number of seconds")
    return seconds
