"""``torchtp reshard SRC DST --tp M``: re-split a checkpoint for another tp size, offline."""

from __future__ import annotations

import argparse
from typing import Any

from ..checkpoint.cli_commands import add_reshard_parser, run


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the subcommand (its logic lives in :mod:`torchtp.checkpoint.cli_commands`)."""
    parser = add_reshard_parser(subparsers)
    parser.set_defaults(run=run)
    return parser
