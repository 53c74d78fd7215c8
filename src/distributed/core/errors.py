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


class UnsupportedStyleError(ValueError):
    """A plan names a style torchtp knows but cannot honour for a module (it refuses
    instead of replicating what the plan splits)."""


def launch_hint(world_size: int) -> str:
    """Return the one-line fix for a missing process group of ``world_size`` ranks."""
    return (
        f"launch one process per rank, e.g. `torchrun --nproc-per-node {world_size} script.py`, "
        "and call torchtp.init_tensor_parallel() before building parallel layers"
    )


class GroupDestroyedError(MissingProcessGroupError):
    """A layer, hook or autograd node used a process group that was destroyed.

    torchtp holds process groups weakly (:mod:`torchtp.comm.group_ref`), so
    ``dist.destroy_process_group()`` frees a group at once; whatever was built
    on it cannot run any more.
    """
