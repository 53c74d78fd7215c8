"""Run a function on N local rank processes (Gloo on CPU, NCCL on GPUs).

Used by ``torchtp verify``/``bench`` and the benchmarks. Each rank joins a
process group through a file store in a temporary directory and writes its
result (or traceback) to a file; the parent enforces a deadline, so a rank
that dies or hangs ends the command with the rank's error instead of a hang.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

# Ranks still running this long after another rank failed are killed.
_FAILURE_GRACE_S = 5.0


class LaunchError(RuntimeError):
    """A rank raised, died or missed the deadline.

    Attributes:
        summary: One line: the earliest failing rank and its exception.
    """

    def __init__(self, message: str, summary: str) -> None:
        super().__init__(message)
        self.summary = summary


def pick_backend(nprocs: int, backend: str = "auto") -> str:
    """``nccl`` when there is one CUDA device per rank (and ``auto``), else ``gloo``.

    Raises:
        ValueError: ``backend`` is not ``auto``/``gloo``/``nccl``, or ``nccl`` lacks GPUs.
    """
    import torch

    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r}; use auto, gloo or nccl")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "nccl" and gpus < nprocs:
        raise ValueError(f"backend nccl needs {nprocs} CUDA devices, found {gpus}; use --backend gloo")
    if backend == "auto":
        return "nccl" if gpus >= nprocs else "gloo"
    return backend


def _thread_lock_for_tqdm() -> None:
    """Give tqdm a thread lock before anything (transformers) makes a progress bar.

    tqdm otherwise creates a multiprocessing semaphore, which a rank ending with
    ``os._exit`` never releases: the parent then warns about leaked semaphores.
    """
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional; without it there is nothing to leak
        return
    tqdm.set_lock(threading.RLock())


def _worker(fn: Callable[..., Any], rank: int, nprocs: int, args: Sequence[Any], workdir: str,
            backend: str, threads: int, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(nprocs), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(nprocs)})
    torch.set_num_threads(threads)  # ranks share the machine's cores
    _thread_lock_for_tqdm()
    ok, value = True, None
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        if nprocs > 1:
            dist.init_process_group(backend, init_method=f"file://{workdir}/store", rank=rank,
                                    world_size=nprocs, timeout=timedelta(seconds=timeout_s))
        value = fn(rank, nprocs, *args)
    except BaseException:
        ok, value = False, traceback.format_exc()
    tmp = Path(workdir) / f"rank{rank}.tmp"
    tmp.write_bytes(pickle.dumps((ok, value, time.time())))
    tmp.rename(Path(workdir) / f"rank{rank}.pkl")
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        os._exit(0 if ok else 1)


def launch(fn: Callable[..., Any], nprocs: int, *args: Any, backend: str = "gloo",
           threads: int = 1, timeout: float = 600.0, collective_timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, nprocs, *args)`` on ``nprocs`` processes and return their results.

    Args:
        fn: Module-level (picklable) function.
        nprocs: Number of rank processes; with 1 no process group is started.
        *args: Picklable arguments.
        backend: ``"gloo"`` or ``"nccl"`` (see :func:`pick_backend`).
        threads: ``torch.set_num_threads`` in every rank.
        timeout: Wall-clock deadline for all ranks, seconds.
        collective_timeout: Process-group timeout inside the ranks, seconds.

    Raises:
        LaunchError: a rank raised (its traceback is in the message), died or hung.
    """
    with tempfile.TemporaryDirectory(prefix="torchtp-launch-") as workdir:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(fn, r, nprocs, args, workdir, backend, threads,
                                   collective_timeout))
                 for r in range(nprocs)]
        for p in procs:
            p.start()
        hung = _wait(procs, time.time() + timeout)
        results = [_read(Path(workdir) / f"rank{r}.pkl") for r in range(nprocs)]
    _raise_failures(results, procs, hung, timeout)
    return [r[1] for r in results if r is not None]


def _wait(procs: list[Any], deadline: float) -> list[int]:
    failed_at: float | None = None
    while any(p.is_alive() for p in procs):
        now = time.time()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now
        if now >= deadline or (failed_at is not None and now - failed_at > _FAILURE_GRACE_S):
            break
        time.sleep(0.02)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
    for p in procs:
        p.join(timeout=10)
    return hung


def _read(path: Path) -> tuple[bool, Any, float] | None:
    return pickle.loads(path.read_bytes()) if path.exists() else None


def _raise_failures(results: list[Any], procs: list[Any], hung: list[int], timeout: float) -> None:
    failed = sorted(((r, res) for r, res in enumerate(results) if res is not None and not res[0]),
                    key=lambda item: item[1][2])
    lines = [f"rank {r} failed:\n{res[1]}" for r, res in failed]
    lines += [f"rank {r} died without a result (exit code {procs[r].exitcode})"
              for r, res in enumerate(results) if res is None and r not in hung]
    if hung:
        lines.append(f"rank(s) {hung} did not finish within {timeout:.0f}s and were killed")
    if lines:
        summary = lines[0].splitlines()[0]
        if failed:
            exc = [ln for ln in str(failed[0][1][1]).strip().splitlines() if not ln.startswith(" ")]
            summary = f"rank {failed[0][0]}: {exc[-1]}"
        raise LaunchError("\n".join(lines), summary)
