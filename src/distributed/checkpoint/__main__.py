"""``python -m torchtp.checkpoint {reshard,consolidate} ...``."""

from __future__ import annotations

import argparse
import sys

from .cli_commands import add_consolidate_parser, add_reshard_parser, run


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the subcommand; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m torchtp.checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    add_reshard_parser(sub)
    add_consolidate_parser(sub)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
