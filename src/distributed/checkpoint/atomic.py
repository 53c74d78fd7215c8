"""Collective saves that fail together and never leave a half-written checkpoint.

* :func:`enter` - every rank must call a save: a barrier through the group's
  store, bounded by the save's ``timeout`` (default 60 s, or ``TP_TIMEOUT``
  if shorter; less when the missing ranks already exited) on *every* rank
  that called it, raises on those ranks naming the ranks that did not,
  instead of hanging in the next collective (any backend, any subset).
* Output goes to ``<dir>.tmp-torchtp`` first; :func:`publish` swaps it in
  with one atomic ``renameat2(RENAME_EXCHANGE)`` on Linux, so ``<dir>``
  always exists and is always complete. Elsewhere it falls back to two
  renames; if a save dies between them, the loader names the surviving
  ``<dir>.old-torchtp`` and the next save restores it before anything else.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
from typing import Any

import torch.distributed as dist

from ..comm import health as _health
from ..comm.objects import all_gather_object
from ..comm.timeout import collective_timeout
from ..guards.agreement import agree

TMP_SUFFIX = ".tmp-torchtp"
OLD_SUFFIX = ".old-torchtp"


def group_size(group: Any) -> int:
    return dist.get_world_size(group) if group is not None else 1


ENTRY_TIMEOUT_S = 60.0


def entry_timeout(timeout: float | None) -> float:
    """A collective save's entry bound: ``timeout``, else 60 s or ``TP_TIMEOUT`` if shorter."""
    return timeout if timeout is not None else min(ENTRY_TIMEOUT_S, collective_timeout())


def enter(what: str, group: Any, timeout: float | None) -> None:
    """Raise unless every rank of ``group`` calls ``what`` within :func:`entry_timeout` seconds.

    Ends early when a missing rank has exited, died or failed this call already.

    Raises:
        RuntimeError: some ranks did not call it (on the ranks that did, after
            at most the bound, whichever ranks they are; the group stays usable).
    """
    if group_size(group) == 1:
        return
    bound = entry_timeout(timeout)
    missing = _health.entry_barrier(group, what, bound)
    if missing:
        raise RuntimeError(
            f"{what} is collective: every rank of the tensor-parallel group (size "
            f"{group_size(group)}) must call it, but {missing} (the bound is timeout= or "
            f"min(60 s, TP_TIMEOUT), here {bound:.0f} s); call it on all ranks, not only on "
            "rank 0")


def check_target(directory: str) -> None:
    """Raise if ``directory`` cannot be (re)written; missing parents are created later.

    Raises:
        ValueError: it is a file, or its nearest existing ancestor is not a
            writable directory.
    """
    directory = os.path.abspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"output path {directory} exists and is not a directory; pass a "
                         "directory path")
    ancestor = os.path.dirname(directory)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ValueError(f"output directory {directory} cannot be created: {ancestor} is not an "
                         "existing directory; pick another location")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"output directory {directory} cannot be written: {ancestor} is not "
                         f"writable (the save writes {os.path.basename(directory)}{TMP_SUFFIX} "
                         "next to the target, then renames it); pick a writable location")


def validate(what: str, directory: str, group: Any, timeout: float | None, extra: dict | None = None) -> str:
    """Entry barrier, then agree on the target directory; returns the temp dir to write."""
    enter(what, group, timeout)
    error = None
    try:
        check_target(directory)
    except ValueError as err:
        error = err
    agree(what, error, {"output directory": os.path.abspath(directory), **(extra or {})}, group)
    return os.path.abspath(directory) + TMP_SUFFIX


def make_tmp(tmp: str) -> None:
    """(Rank 0) a fresh, empty temp directory (after restoring an interrupted swap)."""
    recover(tmp[: -len(TMP_SUFFIX)])
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)


def recover(directory: str) -> None:
    """(Rank 0) put back ``<dir>.old-torchtp`` if a save died between its two renames."""
    directory = os.path.abspath(directory)
    old = directory + OLD_SUFFIX
    if os.path.isdir(old) and not os.path.exists(directory):
        os.rename(old, directory)


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (Linux ``renameat2``); False where that is unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: this file system cannot exchange
        return False
    raise OSError(err, os.strerror(err), b)


def publish(tmp: str, directory: str) -> None:
    """(Rank 0) replace ``directory`` by ``tmp``; ``directory`` never goes missing on Linux."""
    directory = os.path.abspath(directory)
    recover(directory)
    if not os.path.exists(directory):
        os.rename(tmp, directory)
        return
    if _exchange(tmp, directory):
        shutil.rmtree(tmp, ignore_errors=True)  # now the previous checkpoint
        return
    old = directory + OLD_SUFFIX
    shutil.rmtree(old, ignore_errors=True)
    os.rename(directory, old)
    os.rename(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)


def step(what: str, error: BaseException | None, group: Any, cleanup: str | None,
         rank: int) -> None:
    """Agree on ``error``; if anyone failed, rank 0 removes ``cleanup``, then all raise.

    The removal happens before the agreement that raises, so when any rank
    sees the error the temporary directory is already gone.
    """
    if isinstance(error, OSError):
        error = ValueError(f"{what}: cannot write the checkpoint: {error}")
    failed = [error is not None]
    if group_size(group) > 1:
        failed = all_gather_object(error is not None, group, f"{what}'s outcome")
    if any(failed) and rank == 0 and cleanup:
        shutil.rmtree(cleanup, ignore_errors=True)
    agree(what, error, {}, group)


def publish_agreed(what: str, tmp: str, directory: str, group: Any, rank: int) -> None:
    """(All ranks) rank 0 moves ``tmp`` into place; every rank raises if that failed."""
    error: BaseException | None = None
    if rank == 0:
        try:
            publish(tmp, directory)
        except OSError as err:
            error = err
    step(what, error, group, tmp, rank)
