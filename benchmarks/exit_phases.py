"""Where a short job's exit time goes: the phases after its script's last line.

Runs one variant of ``benchmarks/exit_loop.py`` (``work/start/error``, same
jobs, same environment) with two more timestamps in its script: after
``dist.destroy_process_group()`` (the ``dist`` start) and from an ``atexit``
handler registered first, so it runs after every other handler (torchtp's exit
barrier, its wait for Gloo's releases and, for a group torchtp started, its
destroy). The table gives, per phase, the median and the maximum over every
process of ``--runs`` launches:

* END to destroy returned (the script's own ``destroy_process_group``);
* to the last ``atexit`` handler (the exit handlers, torchtp's included);
* to the process's end (the interpreter's finalization: tearing down every
  module and object, joining threads).

    .venv/bin/python benchmarks/exit_phases.py control/dist/mismatch forward/dist/mismatch
        [--runs 5] [--tp 2]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import exit_loop  # the jobs themselves

LAST_HANDLER = ('import atexit as _atexit, time as _time\n'
                '_atexit.register(lambda: print("LASTATEXIT", _time.time(), flush=True))\n')
DESTROY = "    dist.destroy_process_group()\n"
SCRIPT = LAST_HANDLER + exit_loop.SCRIPT.replace(
    DESTROY, DESTROY + '    print("DESTROYED", time.time(), flush=True)\n')
PHASES = ("END to destroy returned", "to the last atexit handler", "to the process's end")


def _process(proc: subprocess.Popen[str]) -> tuple[int, dict[str, float], float]:
    """Exit code, the script's timestamps and when the process ended."""
    out, _err = proc.communicate(timeout=300)
    ended = time.time()
    marks = {}
    for line in out.splitlines():
        word = line.split()
        if len(word) == 2 and word[0] in ("END", "DESTROYED", "LASTATEXIT"):
            marks[word[0]] = float(word[1])
    return proc.returncode, marks, ended


def phases(variant: str, tp: int) -> list[tuple[float, float, float]]:
    """One launch of ``variant``: each process's three phases in seconds."""
    work, start, error = variant.split("/")
    with tempfile.TemporaryDirectory(prefix="exit_phases-") as tmp:
        procs = exit_loop.launch(SCRIPT, tp, tmp, subprocess.DEVNULL, EXIT_LOOP_FAIL_RANK="-1",
                                 EXIT_LOOP_FAIL_HOW="raise", EXIT_LOOP_START=start,
                                 EXIT_LOOP_ERROR=error, EXIT_LOOP_WORK=work)
        with ThreadPoolExecutor(tp) as pool:
            results = list(pool.map(_process, procs))
    out = []
    for code, marks, ended in results:
        if code != 0:
            raise RuntimeError(f"{variant}: a process exited with {code}")
        destroyed = marks.get("DESTROYED", marks["END"])
        out.append((destroyed - marks["END"], marks["LASTATEXIT"] - destroyed,
                    ended - marks["LASTATEXIT"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("variants", nargs="+", help="work/start/error, as in exit_loop.py")
    parser.add_argument("--runs", type=int, default=5, help="launches per variant")
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    print("| variant | " + " | ".join(f"{p} (median / max s)" for p in PHASES) + " |")
    print("|---|" + "---:|" * len(PHASES))
    for variant in args.variants:
        rows = [p for _ in range(args.runs) for p in phases(variant, args.tp)]
        cells = [f"{statistics.median(col):.3f} / {max(col):.3f}" for col in zip(*rows, strict=True)]
        print(f"| {variant} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
