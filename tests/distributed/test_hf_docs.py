"""docs/hf.md's architecture table is generated from the tests and must be current."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_hf_table_is_up_to_date():
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        from gen_hf_table import BEGIN, END, table
    finally:
        sys.path.pop(0)
    page = (ROOT / "docs" / "hf.md").read_text()
    current = page.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert current == table(), "docs/hf.md is stale: run python docs/gen_hf_table.py --write"


def test_moe_table_is_up_to_date():
    import transformers

    sys.path.insert(0, str(ROOT / "docs"))
    try:
        from gen_moe_table import BEGIN, END, table
    finally:
        sys.path.pop(0)
    page = (ROOT / "docs" / "moe.md").read_text()
    current = page.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    fresh = table()
    if f"Generated with transformers {transformers.__version__} " not in current:
        # Another release (make compat): the page describes the pinned one; the
        # generator must still run.
        assert fresh.startswith(f"Generated with transformers {transformers.__version__}")
        return
    assert current == fresh, "docs/moe.md is stale: run python docs/gen_moe_table.py --write"
