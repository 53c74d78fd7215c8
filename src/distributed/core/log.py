"""The ``torchtp`` logger: silent by default, debug output with ``TP_DEBUG=1``.

Library code never prints; everything goes through :data:`logger`.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("torchtp")

_TRUTHY = {"1", "true", "yes", "on", "debug"}

# TP_CHECK_SHAPES=1: every collective first checks that all ranks pass the same
# shape and dtype. Read once (configure_from_env), not on every collective.
CHECK_SHAPES = False
# TP_CHECK_INPUTS=0: skip the check that every TP rank got the same inputs (on by
# default, every forward; see torchtp.guards.input_check). Read once too: forwards are hot.
CHECK_INPUTS = True
_FALSY = {"0", "false", "no", "off"}


def debug_enabled() -> bool:
    """Return True when debug logging is on for the ``torchtp`` logger."""
    return logger.isEnabledFor(logging.DEBUG)


def configure_from_env() -> None:
    """Turn on debug logging when ``TP_DEBUG`` is set to a truthy value.

    Adds one stderr handler tagged with the process rank (only once), so that
    ``TP_DEBUG=1 torchrun ...`` shows each rank's layer swaps and collectives.
    Also reads ``TP_CHECK_SHAPES`` and ``TP_CHECK_INPUTS``.
    """
    global CHECK_SHAPES, CHECK_INPUTS
    CHECK_SHAPES = os.environ.get("TP_CHECK_SHAPES", "").strip().lower() in _TRUTHY
    CHECK_INPUTS = os.environ.get("TP_CHECK_INPUTS", "").strip().lower() not in _FALSY
    if os.environ.get("TP_DEBUG", "").strip().lower() not in _TRUTHY:
        return
    logger.setLevel(logging.DEBUG)
    if any(getattr(h, "_torchtp", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler()
    rank = os.environ.get("RANK", "0")
    handler.setFormatter(logging.Formatter(f"[torchtp rank{rank}] %(levelname)s %(message)s"))
    handler._torchtp = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
