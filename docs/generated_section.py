"""The generated section of a docs page: read it, and the command that rewrites it.

``gen_hf_table.py`` and ``gen_moe_table.py`` each generate one table between two
HTML comments of a page; tests/distributed/test_hf_docs.py compares the page's
section with a fresh generation.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def section(page: Path, begin: str, end: str) -> str:
    """The text between ``begin`` and ``end`` in ``page``, stripped."""
    return page.read_text().split(begin, 1)[1].split(end, 1)[0].strip()


def main(argv: list[str], table: Callable[[], str], page: Path, begin: str, end: str) -> int:
    """Print ``table()``, or with ``--write`` put it between the markers of ``page``."""
    text = table()
    if "--write" not in argv:
        print(text)
        return 0
    head, _, rest = page.read_text().partition(begin)
    _, _, tail = rest.partition(end)
    page.write_text(f"{head}{begin}\n{text}\n{end}{tail}")
    return 0
