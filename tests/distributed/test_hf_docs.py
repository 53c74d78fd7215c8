"""The generated tables of docs/hf.md, docs/moe.md and docs/planning.md must be current."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from ._hf_models import NEEDS_MAMBA_TORCH_PATH

ROOT = Path(__file__).resolve().parents[2]


def _generated(generator: str, page: str) -> tuple[str, Any]:
    """The page's generated section as it stands, and the generator's ``table``."""
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        gen = importlib.import_module(generator)
        from generated_section import section
    finally:
        sys.path.pop(0)
    return section(ROOT / "docs" / page, gen.BEGIN, gen.END), gen.table


@NEEDS_MAMBA_TORCH_PATH
def test_hf_table_is_up_to_date():
    import transformers

    current, table = _generated("gen_hf_table", "hf.md")
    fresh = table()  # the generator runs on every release
    pinned = re.search(r"^transformers==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    if pinned is None or transformers.__version__ != pinned.group(1):
        return  # another release (make compat): the page describes the pinned one
    assert current == fresh, "docs/hf.md is stale: run python docs/gen_hf_table.py --write"


def test_moe_table_is_up_to_date():
    import transformers

    current, table = _generated("gen_moe_table", "moe.md")
    fresh = table()
    if f"Generated with transformers {transformers.__version__} " not in current:
        # Another release (make compat): the page describes the pinned one; the
        # generator must still run.
        assert fresh.startswith(f"Generated with transformers {transformers.__version__}")
        return
    assert current == fresh, "docs/moe.md is stale: run python docs/gen_moe_table.py --write"


@pytest.mark.slow  # plans every published job from scratch (about a minute)
def test_planning_table_is_up_to_date():
    current, table = _generated("gen_planning_table", "planning.md")
    assert current == table(), "docs/planning.md is stale: run python docs/gen_planning_table.py --write"
