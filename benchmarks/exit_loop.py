"""Exit codes of many short tensor-parallel runs: does any run end abnormally?

Each run starts ``--tp`` fresh Python processes the way ``torchrun`` does
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the environment),
and each process starts the group, wraps a tiny model, runs three forwards
and ends. ``--start torchtp`` calls ``torchtp.init_tensor_parallel()`` and
returns from the script, leaving the exit to torchtp's shutdown;
``--start dist`` calls ``dist.init_process_group("gloo")`` itself (as
Trainer, accelerate and Lightning do) and ends with
``dist.destroy_process_group()``; ``both`` runs each. ``--error mismatch``
first feeds each rank a different batch in training mode and handles the
``RankMismatchError`` the input check raises on every rank. A run passes when
every process exits with 0. Torch's Gloo can abort a process at exit
("terminate called without an active exception", exit code -6) after all of
its work is done; this counts how often (column SIGABRT).

    .venv/bin/python benchmarks/exit_loop.py [--runs 100] [--tp 2] [--fail-rank R] [--jobs J]
        [--start torchtp|dist|both] [--error none|mismatch|both] [--load N]

``--runs`` is per variant. ``--jobs J`` runs J launches at a time and
``--load N`` starts N busy-loop processes beside them (more load, as on a
busy node).

``--fail-rank R`` makes rank R fail after the first all-reduce instead (it
raises RuntimeError; with ``--fail-how input`` it passes an input of the
wrong width, which torchtp's layer rejects on that rank only; with ``exit`` it
calls ``sys.exit(1)``); the run then
passes when rank R exits with 1 and the other ranks report an error naming
rank R, all within ``--deadline`` seconds (no rank waits for a timeout).
"lag" is the time between the first and the last process exit of a run.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

SCRIPT = r"""
import os, sys, torch
from torch import nn
import torchtp

start = os.environ.get("EXIT_LOOP_START", "torchtp")
if start == "torchtp":
    torchtp.init_tensor_parallel()
else:  # as Trainer, accelerate and Lightning do: torchtp never started this group
    torch.distributed.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
tp = torchtp.DistributedModelWrapper(model)
fail_rank = int(os.environ["EXIT_LOOP_FAIL_RANK"])
how = os.environ["EXIT_LOOP_FAIL_HOW"]
failing = torch.distributed.get_rank() == fail_rank
x = torch.randn(2, 32)
if os.environ.get("EXIT_LOOP_ERROR") == "mismatch":
    # Rank-dependent batch: the training forward's input check raises
    # RankMismatchError on every rank; the script handles it and goes on.
    try:
        tp(x + torch.distributed.get_rank())
        raise AssertionError("the input check did not raise")
    except torchtp.RankMismatchError:
        pass
# The fault comes at step 4: by then every rank remembers the collectives' shapes as
# agreed (health.before keys them by the 3 collectives before), so the others are
# inside their next collective, not checking its shape, when the failing rank stops.
with torch.no_grad():
    for step in range(6):
        if failing and step == 4 and how == "input":
            x = torch.randn(2, 31)  # wrong input on this rank only
        if failing and step == 4 and how == "raise":
            raise RuntimeError("boom")  # after four forwards' all-reduces
        if failing and step == 4 and how == "exit":
            print("bad batch: exiting", file=sys.stderr)
            sys.exit(1)  # no exception reaches sys.excepthook
        y = tp(x)
print("ok", float(y.sum()))
if start == "dist":
    torch.distributed.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_run(tp: int, fail_rank: int, how: str, deadline: float, start: str = "torchtp",
            error: str = "none") -> tuple[list[int | None], float, list[str]]:
    """Start ``tp`` rank processes.

    ``start``: ``"torchtp"`` (``init_tensor_parallel``) or ``"dist"``
    (``dist.init_process_group``, ending with ``dist.destroy_process_group()``);
    ``error``: ``"mismatch"`` feeds each rank a different batch first and
    handles the ``RankMismatchError``.

    Returns:
        Their exit codes (``None``: killed at the deadline), the seconds between
        the first and the last process exit (how long the others took to be
        told), and the last stderr line of each.
    """
    port = _free_port()
    procs = []
    for rank in range(tp):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(tp), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(tp), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   EXIT_LOOP_FAIL_RANK=str(fail_rank), EXIT_LOOP_FAIL_HOW=how,
                   EXIT_LOOP_START=start, EXIT_LOOP_ERROR=error,
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", SCRIPT], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True))
    start = time.monotonic()
    ended: dict[int, float] = {}
    while len(ended) < tp and time.monotonic() - start < deadline:
        for rank, p in enumerate(procs):
            if rank not in ended and p.poll() is not None:
                ended[rank] = time.monotonic()
        time.sleep(0.02)
    codes: list[int | None] = []
    tails: list[str] = []
    for rank, p in enumerate(procs):
        if rank not in ended:
            p.kill()
        err = p.communicate()[1].strip()
        codes.append(p.returncode if rank in ended else None)
        tails.append(err.splitlines()[-1] if err else "")
    lag = max(ended.values()) - min(ended.values()) if ended else deadline
    return codes, lag, tails


def _busy_loops(count: int) -> list[subprocess.Popen[bytes]]:
    """``count`` processes spinning on a core each, as other jobs on a busy node do."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def _variant(args: argparse.Namespace, start: str, error: str) -> tuple[Counter[str], list[float]]:
    """Run ``args.runs`` launches of one variant; count passes, failures and SIGABRTs."""
    outcomes: Counter[str] = Counter()
    seconds = []

    def launch(_i: int) -> tuple[list[int | None], float, list[str]]:
        return one_run(args.tp, args.fail_rank, args.fail_how, args.deadline, start, error)

    with ThreadPoolExecutor(args.jobs) as pool:
        for i, (codes, took, tails) in enumerate(pool.map(launch, range(args.runs))):
            seconds.append(took)
            if args.fail_rank < 0:
                ok = all(c == 0 for c in codes)
            else:
                others = [t for r, t in enumerate(tails) if r != args.fail_rank]
                ok = codes[args.fail_rank] == 1 and all(
                    f"rank {args.fail_rank}" in t for t in others) and None not in codes
            outcomes["pass" if ok else "FAIL"] += 1
            outcomes["abort"] += any(c == -signal.SIGABRT for c in codes)
            if not ok:
                print(f"{start}/{error} run {i}: exit codes {codes} after {took:.1f}s; "
                      f"stderr tails: {tails}", flush=True)
            if (i + 1) % 10 == 0:
                print(f"{start}/{error}: {i + 1} runs, {outcomes['pass']} passed",
                      file=sys.stderr, flush=True)
    return outcomes, sorted(seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=100, help="runs per variant")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--fail-rank", type=int, default=-1)
    ap.add_argument("--fail-how", choices=["raise", "input", "exit"], default="raise",
                    help="the failing rank raises RuntimeError, passes a wrong input width, "
                    "or calls sys.exit(1)")
    ap.add_argument("--start", choices=["torchtp", "dist", "both"], default="torchtp",
                    help="init_tensor_parallel, dist.init_process_group (ending with "
                    "destroy_process_group), or one variant of each")
    ap.add_argument("--error", choices=["none", "mismatch", "both"], default="none",
                    help="mismatch: a handled RankMismatchError (different batches) first")
    ap.add_argument("--load", type=int, default=0, metavar="N",
                    help="busy-loop processes running beside the launches")
    ap.add_argument("--deadline", type=float, default=300.0, help="seconds per run")
    ap.add_argument("--jobs", type=int, default=1, help="launches running at the same time")
    args = ap.parse_args()
    starts = ["torchtp", "dist"] if args.start == "both" else [args.start]
    errors = ["none", "mismatch"] if args.error == "both" else [args.error]
    loops = _busy_loops(args.load)

    def stop(*_: object) -> None:  # SIGTERM (timeout, kill): leave no busy loop behind
        for p in loops:
            p.kill()
        os._exit(143)

    signal.signal(signal.SIGTERM, stop)
    rows = []
    try:
        for start in starts:
            for error in errors:
                rows.append((start, error, *_variant(args, start, error)))
    finally:
        for p in loops:
            p.kill()
            p.wait()
    fail = f"{args.fail_rank} ({args.fail_how})" if args.fail_rank >= 0 else "-"
    print(f"busy loops beside: {args.load}, launches at a time: {args.jobs}")
    print("| start | handled error | runs | tp | fail rank | passed | failed | SIGABRT "
          "| median lag s | max lag s |")
    print("|---|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for start, error, outcomes, seconds in rows:
        print(f"| {start} | {error} | {args.runs} | {args.tp} | {fail} | {outcomes['pass']} "
              f"| {outcomes['FAIL']} | {outcomes['abort']} | {seconds[len(seconds) // 2]:.1f} "
              f"| {seconds[-1]:.1f} |")


if __name__ == "__main__":
    main()
