"""Run every Python example in the Markdown docs, so the docs cannot drift from the code.

Usage (from the repository root):
    python docs/check_examples.py README.md docs/*.md

A ```python block runs in one process unless the HTML comment right above it says
otherwise: ``<!-- run: torchrun N -->`` runs it with ``torchrun --nproc-per-node N``,
``<!-- run: skip -->`` skips it (GPU-only or fragments; the comment must say why).
Exits non-zero if any example fails.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BLOCK = re.compile(r"(?:<!-- run: (?P<how>[^>]*?) -->\s*\n)?```python\n(?P<code>.*?)```", re.S)


def examples(path: Path) -> list[tuple[int, str, str]]:
    """(line number, how, code) for each python block in ``path``."""
    text = path.read_text()
    found = []
    for m in BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("code"))
        found.append((line, (m.group("how") or "python").strip(), m.group("code")))
    return found


def command(how: str, script: str) -> list[str] | None:
    if how == "python":
        return [sys.executable, script]
    if how.startswith("torchrun "):
        # torchrun's module, not its script: a compat venv reusing another
        # venv's packages (make compat) has no torchrun in its bin/.
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", how.split()[1], script]
    if how.startswith("skip"):
        return None
    raise ValueError(f"unknown run marker {how!r}")


def run_one(how: str, code: str, env: dict[str, str]) -> tuple[int, str, str]:
    """Run one example; returns (exit code, output tail, note)."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(code)
    try:
        cmd = command(how, f.name)
        assert cmd is not None
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        note = ""
        if proc.returncode and _gloo_exit_abort(proc.stderr):
            # torch's Gloo teardown can abort a process *after* its work is done
            # (docs/troubleshooting.md); rerun once instead of failing on it.
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
            note = " [rerun once after a Gloo abort at interpreter exit]"
        return proc.returncode, proc.stdout[-3000:] + "\n" + proc.stderr[-3000:], note
    finally:
        os.unlink(f.name)


def main(paths: list[str]) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    todo = [(f"{path}:{line}", how, code) for path in map(Path, paths)
            for line, how, code in examples(path)]
    # Examples are independent processes that mostly wait on start-up and Gloo:
    # a few at a time finish sooner than one by one, in the same order of output.
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {where: pool.submit(run_one, how, code, env)
                   for where, how, code in todo if command(how, "x") is not None}
        failures = 0
        for where, how, _ in todo:
            if where not in futures:
                print(f"skip {where} ({how})")
                continue
            code, tail, note = futures[where].result()
            print(f"{'ok  ' if code == 0 else 'FAIL'} {where} ({how}){note}")
            if code:
                failures += 1
                print(tail)
    print(f"{failures} failing example(s)")
    return 1 if failures else 0


def _gloo_exit_abort(stderr: str) -> bool:
    """The known torch/Gloo abort at interpreter exit, and no Python traceback before it."""
    return ("terminate called without an active exception" in stderr
            and "Traceback (most recent call last)" not in stderr.split("terminate called")[0])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
