"""Every Python example in README.md and docs/ runs (torchrun ones with real Gloo ranks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# About 40 examples, 3 at a time: ~2 min idle, over 5 under a busy machine's load,
# so the per-test timeout follows the subprocess's own 600 s bound.
@pytest.mark.timeout(660)
def test_docs_examples_run():
    pages = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
    proc = subprocess.run([sys.executable, "docs/check_examples.py", *pages], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "0 failing example(s)" in proc.stdout
