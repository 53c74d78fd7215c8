"""Fixtures for multi-process tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .harness import run_ranks


@pytest.fixture
def ranks(tmp_path: Path) -> Callable[..., list[Any]]:
    """``ranks(fn, world_size, *args, **kw)``: :func:`run_ranks` bound to this test's tmp_path."""

    def run(fn: Callable[..., Any], world_size: int, *args: Any, **kw: Any) -> list[Any]:
        return run_ranks(fn, world_size, *args, tmp_path=tmp_path, **kw)

    return run
