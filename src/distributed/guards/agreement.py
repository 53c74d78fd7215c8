"""Make every rank reach the same verdict before any rank moves on.

A check that fails on one rank only (a different plan, a different world
size, a rank-specific error) would otherwise leave the other ranks waiting in
their next collective until a 10-30 minute timeout. Each rank sends its
verdict and a fingerprint of what it is about to do; all ranks then raise the
same error, naming the ranks and what differs, or all go on.
"""

from __future__ import annotations

import builtins
from typing import Any

import torch.distributed as dist

from ..comm.objects import all_gather_object
from ..comm.runtime import ProcessGroup
from ..core.errors import RankMismatchError


def agree(
    what: str, error: BaseException | None, fingerprint: dict[str, Any],
    group: ProcessGroup | None,
) -> None:
    """Exchange verdicts across ``group`` and raise on every rank if any differ.

    Args:
        what: The operation being checked (for messages), e.g. ``"DistributedModelWrapper"``.
        error: This rank's validation error, or ``None``.
        fingerprint: Values that must be equal on all ranks, by name.
        group: The group that must agree; ``None`` (one process) raises
            ``error`` directly.

    Raises:
        The first failing rank's error type (``ValueError``/``TypeError``...)
        with its message, or :class:`RankMismatchError` when the fingerprints
        differ.
    """
    if group is None or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    # Only builtin exception classes travel (by name): pickling an arbitrary
    # class can fail on one rank, which would leave the others in the gather.
    mine = (None if error is None else (type(error).__name__, str(error)), fingerprint)
    # A rank that died or timed out is named, if it told us (InconsistentGroupError).
    everyone = all_gather_object(mine, group, f"{what}'s agreement")
    _raise_first_error(what, everyone, error)
    _raise_on_mismatch(what, [fp for _, fp in everyone])


def _raise_first_error(what: str, everyone: list[Any], own: BaseException | None) -> None:
    failed = [(r, err) for r, (err, _) in enumerate(everyone) if err is not None]
    if not failed:
        return
    if own is not None:
        raise own
    rank, (name, msg) = failed[0]
    builtin = getattr(builtins, name, None)
    exc_type = builtin if isinstance(builtin, type) and issubclass(builtin, Exception) \
        else RuntimeError
    raise exc_type(f"{what} failed on rank {rank} (ranks {[r for r, _ in failed]} failed): {msg}")


def _raise_on_mismatch(what: str, prints: list[dict[str, Any]]) -> None:
    keys = list(dict.fromkeys(k for fp in prints for k in fp))
    for key in keys:
        values = [fp.get(key) for fp in prints]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {_short(v)}" for r, v in enumerate(values))
            raise RankMismatchError(
                f"{what}: {key} must match across all ranks: {per_rank}; launch every rank "
                "with the same model, plan and arguments")


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
