"""Integer options from torchtp's environment variables: one parser, one error.

(torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` are read by
:mod:`torchtp.comm.runtime` itself: a wrap at world size 1 touches no more files.)
"""

from __future__ import annotations

import os


def env_int(name: str, default: int, minimum: int, meaning: str) -> int:
    """``int(os.environ[name])``, or ``default`` when it is unset or empty.

    Args:
        name: The variable.
        default: Its value when unset.
        minimum: The least value allowed.
        meaning: What the value means, for the error.

    Raises:
        ValueError: the value is not an integer >= ``minimum``.
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"{name}={raw!r} must be an integer >= {minimum} ({meaning})")
    return value
