"""docs/decisions.md is one table of four columns, numbered once each, in order."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "decisions.md"


def _rows() -> list[str]:
    return [line for line in DOC.read_text().splitlines() if re.match(r"^\| \d+ \|", line)]


def test_every_decision_has_the_four_columns():
    # `| # | the guide says | torchtp does | why |`: three inner separators.
    bad = [row[:60] for row in _rows() if len(re.findall(r" \| ", row)) != 3]
    assert bad == []


def test_decisions_are_numbered_once_each_in_order():
    numbers = [int(row.split("|")[1]) for row in _rows()]
    assert numbers == sorted(set(numbers))
