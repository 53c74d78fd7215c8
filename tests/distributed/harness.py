"""Run a function on N real Gloo processes and report every rank's outcome.

Each rank runs in its own process (a crash or a hang never takes pytest
down), joins a Gloo group through a file store under the test's ``tmp_path``
with a short collective timeout, and writes its result or traceback to a
file; its standard error goes to a file too, whose end is quoted for a rank
that failed or died (a SIGABRT leaves no traceback, only what the C++ runtime
printed). The parent enforces a hard wall-clock deadline, kills what is left, and
raises :class:`RankFailure` with every failing rank's traceback, earliest first.
A run whose group could not be joined on some rank is started again, after a
pause, and the last time from freshly spawned processes.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

# Ranks that still run this long after another rank failed are killed: Gloo's
# own timeout would end them too, but only after gloo_timeout.
FAILURE_GRACE_S = 5.0
# How each run is started when the harness's own init_process_group fails on a
# rank (Gloo's connectFullMesh "Connection closed by peer", 3 times in a row
# within 0.5 s on the busy 2-core CI machine): the same fork server twice, then
# processes that share nothing with it. Spawned ranks import torch themselves
# (seconds), which is why spawn is kept for the last attempt.
START_METHODS = ("forkserver", "forkserver", "spawn")
# Seconds between attempts, so whatever broke the rendezvous has time to clear.
RETRY_PAUSE_S = 2.0
# How much of a failing rank's standard error a failure report quotes (its end).
STDERR_TAIL_CHARS = 4000


class RankFailure(AssertionError):
    """One or more ranks raised, crashed or hung."""


@dataclass
class _Outcome:
    rank: int
    ok: bool
    value: Any
    finished_at: float
    started: bool = True  # False: the harness's own init_process_group failed


def _worker(fn: Callable[..., Any], rank: int, world_size: int, args: Sequence[Any],
            workdir: str, init: str, gloo_timeout: float, env: dict[str, str]) -> None:
    import torch
    import torch.distributed as dist

    _stderr_to(Path(workdir) / f"rank{rank}.stderr")
    faulthandler.enable()  # a SIGABRT / SIGSEGV writes the Python stacks there too
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)})
    torch.set_num_threads(1)  # N ranks share 2 cores
    # torchtp was imported by the fork server before env was set: re-read it as a
    # freshly started process would (TP_DEBUG).
    import torchtp

    torchtp.configure_from_env()
    started = False
    try:
        if init == "file":
            dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank,
                                    world_size=world_size,
                                    timeout=timedelta(seconds=gloo_timeout))
        started = True
        outcome = _Outcome(rank, True, fn(rank, world_size, *args), time.time())
    except BaseException:
        outcome = _Outcome(rank, False, traceback.format_exc(), time.time(), started)
    _write(Path(workdir) / f"rank{rank}.pkl", outcome)
    sys.stderr.flush()  # os._exit below skips Python's flush
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        os._exit(0 if outcome.ok else 1)


def _stderr_to(path: Path) -> None:
    """Send this process's fd 2 (Python's and C++'s writes alike) to ``path``."""
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.close(fd)


def _stderr_tail(workdir: Path, rank: int) -> str:
    """The end of ``rank``'s standard error, indented, or ``""`` when it wrote none."""
    path = workdir / f"rank{rank}.stderr"
    text = path.read_text(errors="replace").strip() if path.exists() else ""
    if not text:
        return ""
    cut = text[-STDERR_TAIL_CHARS:]
    head = "  [...]\n" if len(cut) < len(text) else ""
    return (f"\n  stderr of rank {rank} (its end):\n{head}"
            + "\n".join("  | " + line for line in cut.splitlines()))


def _write(path: Path, outcome: _Outcome) -> None:
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_bytes(pickle.dumps(outcome))
    except Exception:  # unpicklable return value: report it instead
        msg = f"rank {outcome.rank} returned an unpicklable value:\n{traceback.format_exc()}"
        tmp.write_bytes(pickle.dumps(_Outcome(outcome.rank, False, msg, time.time())))
    tmp.rename(path)


def _read(path: Path) -> _Outcome | None:
    return pickle.loads(path.read_bytes()) if path.exists() else None


def _context(method: str) -> mp.context.BaseContext:
    ctx = mp.get_context(method)
    if method == "forkserver":
        # Children fork from a server that imported torch once: starts take ms, not s.
        # transformers' modeling_utils too (about 1.5 s per rank when imported there):
        # most ranks build an HF model. It imports accelerate and torch._dynamo with it, so
        # ranks start with them loaded; the late import of a framework (torchtp's import
        # watch) is tested in fresh subprocesses (test_no_import_patches), and peft and
        # lightning, whose late import some ranks watch, are not preloaded.
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torchtp",
                                    "transformers.modeling_utils"])
    return ctx


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, tmp_path: Path,
              timeout: float = 120.0, gloo_timeout: float = 20.0, init: str = "file",
              env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes.

    Args:
        fn: A module-level (picklable) function.
        world_size: Number of rank processes.
        *args: Extra picklable arguments for ``fn``.
        tmp_path: Directory for the file store and result files.
        timeout: Hard wall-clock deadline for all ranks together, in seconds.
        gloo_timeout: Collective timeout inside the ranks, in seconds.
        init: ``"file"`` starts a Gloo group; ``"none"`` leaves it to ``fn``
            (the torchrun variables RANK/WORLD_SIZE/LOCAL_RANK are set either way).
        env: Extra environment variables for the ranks.

    Returns:
        Each rank's return value, in rank order.

    Raises:
        RankFailure: a rank raised, died, or the deadline passed.
    """
    for attempt, method in enumerate(START_METHODS):
        workdir = tmp_path / f"ranks-{time.monotonic_ns()}"
        workdir.mkdir(parents=True)
        ctx = _context(method)
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(fn, r, world_size, args, str(workdir), init, gloo_timeout,
                                   dict(env or {})))
                 for r in range(world_size)]
        start = time.time()
        for p in procs:
            p.start()
        hung = _wait(procs, workdir, start + timeout)
        outcomes = [_read(workdir / f"rank{r}.pkl") for r in range(world_size)]
        unstarted = [o for o in outcomes if o is not None and not o.started]
        if not unstarted or attempt == len(START_METHODS) - 1:
            break
        # The harness's own rendezvous failed on a rank (fn never ran there):
        # discard this run, say what every rank saw, start all afresh.
        print(f"run_ranks: attempt {attempt + 1} ({method}) could not start the group; "
              f"starting all {world_size} ranks again with {START_METHODS[attempt + 1]}:\n"
              + _summary(outcomes, procs, start), file=sys.stderr)
        time.sleep(RETRY_PAUSE_S * (attempt + 1))
    _raise_failures(outcomes, procs, hung, start, timeout, workdir)
    return [o.value for o in outcomes if o is not None]


def _summary(outcomes: list[_Outcome | None], procs: list[Any], start: float) -> str:
    """One line or traceback per rank: how far it got in this attempt."""
    lines = []
    for r, o in enumerate(outcomes):
        if o is None:
            lines.append(f"rank {r}: no result (exit code {procs[r].exitcode})")
        else:
            state = "ok" if o.ok else ("init failed" if not o.started else "fn failed")
            lines.append(f"rank {r}: {state} at +{o.finished_at - start:.2f}s"
                         + ("" if o.ok else f"\n{o.value}"))
    return "\n".join(lines)


def _wait(procs: list[Any], workdir: Path, deadline: float) -> list[int]:
    """Join ranks until all end, the deadline passes, or a failure's grace ends."""
    failed_at: float | None = None
    while any(p.is_alive() for p in procs):
        now = time.time()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now
        if now >= deadline or (failed_at is not None and now - failed_at > FAILURE_GRACE_S):
            break
        time.sleep(0.02)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
    for p in procs:
        p.join(timeout=10)
    return hung


def _raise_failures(outcomes: list[_Outcome | None], procs: list[Any], hung: list[int],
                    start: float, timeout: float, workdir: Path) -> None:
    failures = [o for o in outcomes if o is not None and not o.ok]
    failures.sort(key=lambda o: o.finished_at)
    lines = [f"rank {o.rank} failed at +{o.finished_at - start:.2f}s:\n{o.value}"
             + _stderr_tail(workdir, o.rank) for o in failures]
    for r, o in enumerate(outcomes):
        if o is None and r not in hung:
            lines.append(f"rank {r} died without a result (exit code {procs[r].exitcode})"
                         + _stderr_tail(workdir, r))
        elif o is not None and o.ok and r not in hung and procs[r].exitcode not in (0, None):
            # fn returned, then the process did not end cleanly (group teardown)
            lines.append(f"rank {r} returned, then exited with code {procs[r].exitcode}"
                         + _stderr_tail(workdir, r))
    if hung:
        why = "after another rank failed" if failures else f"within the {timeout:.0f}s deadline"
        lines.append(f"rank(s) {hung} did not finish {why} and were killed"
                     + "".join(_stderr_tail(workdir, r) for r in hung))
    if lines:
        raise RankFailure(f"{len(lines)} problem(s) across {len(outcomes)} ranks:\n\n"
                          + "\n\n".join(lines))
