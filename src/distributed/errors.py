"""Exception types raised by torchtp.

Each subclasses a builtin (``RuntimeError`` / ``ValueError``) so callers that
catch the builtin keep working.
"""

from __future__ import annotations


class MissingProcessGroupError(RuntimeError):
    """A collective across several ranks was needed but no process group exists."""


class RankMismatchError(RuntimeError):
    """Ranks disagree about something that must be identical on all of them."""


class InconsistentGroupError(RuntimeError):
    """A rank failed between collectives, so the group's collectives no longer line up.

    Raised by every later torchtp collective of that group, on every rank that
    knows of the failure, instead of computing on misaligned collectives.
    """


def launch_hint(world_size: int) -> str:
    """Return the one-line fix for a missing process group of ``world_size`` ranks."""
    return (
        f"launch one process per rank, e.g. `torchrun --nproc-per-node {world_size} script.py`, "
        "and call torchtp.init_tensor_parallel() before building parallel layers"
    )


def valid_sizes(*dims: int, limit: int = 64) -> list[int]:
    """Return the tp sizes in ``1..limit`` that divide every one of ``dims``.

    Args:
        *dims: Dimension sizes that must all be divisible by the tp size.
        limit: Largest tp size to list.
    """
    return [n for n in range(1, limit + 1) if all(d % n == 0 for d in dims)]
