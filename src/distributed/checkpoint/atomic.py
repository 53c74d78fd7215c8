"""Collective saves that fail together and never leave a half-written checkpoint.

* :func:`enter` - every rank must call a save: a Gloo ``monitored_barrier``
  with a short timeout raises on the ranks that did call it, naming the ranks
  that did not, instead of hanging in the next collective.
* Output goes to ``<dir>.tmp-torchtp`` first; :func:`publish` swaps it in
  with renames, so an interrupted save leaves the previous ``<dir>`` intact.
"""

from __future__ import annotations

import os
import shutil
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..agreement import agree

TMP_SUFFIX = ".tmp-torchtp"
OLD_SUFFIX = ".old-torchtp"


def group_size(group: Any) -> int:
    return dist.get_world_size(group) if group is not None else 1


def enter(what: str, group: Any, timeout: float) -> None:
    """Raise unless every rank of ``group`` calls ``what`` within ``timeout`` seconds.

    Raises:
        RuntimeError: some ranks did not call it (on the ranks that did).
    """
    if group_size(group) == 1:
        return
    if dist.get_backend(group) != "gloo":
        return  # monitored_barrier is Gloo-only; the agreement below still checks arguments
    try:
        dist.monitored_barrier(group, timeout=timedelta(seconds=timeout))
    except RuntimeError as err:
        raise RuntimeError(
            f"{what} is collective: every rank of the tensor-parallel group (size "
            f"{group_size(group)}) must call it, but not all ranks arrived within {timeout:.0f} s "
            f"({err}); call it on all ranks, not only on rank 0") from err


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


def validate(what: str, directory: str, group: Any, timeout: float, extra: dict | None = None) -> str:
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
    """(Rank 0) a fresh, empty temp directory."""
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)


def publish(tmp: str, directory: str) -> None:
    """(Rank 0) replace ``directory`` by ``tmp`` using renames only."""
    directory = os.path.abspath(directory)
    old = directory + OLD_SUFFIX
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(directory):
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
        everyone: list[Any] = [None] * group_size(group)
        dist.all_gather_object(everyone, error is not None, group=group)
        failed = everyone
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
