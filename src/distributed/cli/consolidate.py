"""``torchtp consolidate SRC DST``: one HF-format directory from a sharded checkpoint."""

from __future__ import annotations

import argparse
from typing import Any

from ..checkpoint.cli_commands import add_consolidate_parser, run


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the subcommand (its logic lives in :mod:`torchtp.checkpoint.cli_commands`)."""
    parser = add_consolidate_parser(subparsers)
    parser.set_defaults(run=run)
    return parser
