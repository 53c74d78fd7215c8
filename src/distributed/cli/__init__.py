"""The ``torchtp`` command line: ``estimate``, ``plan``, ``verify``, ``bench``, ``demo``,
``reshard``, ``consolidate``.

Each subcommand lives in its own module with ``register(subparsers)`` and a
``run(args) -> int`` set as the parser default; :data:`SUBCOMMANDS` maps names
to modules.

An entry point. May import anything in torchtp.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ._common import CliError

# name -> module under torchtp.cli; imported lazily so `torchtp --help` stays fast.
SUBCOMMANDS: dict[str, str] = {
    "estimate": "estimate",
    "plan": "plan",
    "verify": "verify",
    "bench": "bench",
    "demo": "demo",
    "reshard": "reshard",
    "consolidate": "consolidate",
}

DESCRIPTION = """Tensor parallelism for PyTorch models: will it work, how much memory, how fast.

examples:
  torchtp demo                                      # everything on a small local Llama
  torchtp plan ./my-llama --tp 4                    # plan, memory per rank, blockers
  torchtp plan ./my-llama --gpus 64 --out layout.json    # dp x tp x pp x ep x cp, ranked
  torchtp verify ./my-llama --tp 2 --grad           # sharded == unsharded?
  torchtp bench ./my-llama --tp 2                   # prefill/decode latency, tokens/s
  torchtp estimate --model ./my-llama --tp 1,2,4,8 --hardware h100-nvlink
  torchtp reshard ./ckpt-tp2 ./ckpt-tp4 --tp 4           # offline, one tensor at a time
  torchtp consolidate ./ckpt-tp4 ./hf-model              # back to one HF directory

run `torchtp <command> --help` for each command's options and examples.
"""


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="torchtp", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    from .._version import __version__

    parser.add_argument("--version", action="version", version=f"torchtp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS.values():
        importlib.import_module(f"{__name__}.{module}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 check failed, 2 bad input).

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv``.
    """
    from ._launch import LaunchError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse printed usage or help
        return int(exc.code or 0)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.run(args))
    except CliError as err:
        print(f"torchtp {args.command}: error: {err}", file=sys.stderr)
        return 2
    except LaunchError as err:
        print(f"torchtp {args.command}: error: a rank failed: {err.summary}\n"
              f"full per-rank report:\n{err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"torchtp {args.command}: interrupted", file=sys.stderr)
        return 130

