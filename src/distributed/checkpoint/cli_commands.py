"""``torchtp reshard`` and ``torchtp consolidate``: argparse front ends to :mod:`.offline`.

Each command runs on one machine without a process group and streams one
tensor at a time. ``add_*_parser`` plug them into a parent ``torchtp`` CLI;
``*_main(argv)`` run them alone (``python -m torchtp.checkpoint ...``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

_RESHARD_HELP = "rewrite a checkpoint (torchtp sharded or HF) as a torchtp checkpoint for --tp ranks"
_CONSOLIDATE_HELP = "rewrite a torchtp sharded checkpoint as one HF-format directory"


def _reshard_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("src", help="torchtp sharded checkpoint (any saved tp) or HF model directory")
    p.add_argument("dst", help="output directory (replaced only once fully written)")
    p.add_argument("--tp", type=int, required=True, help="target tensor-parallel size")
    p.add_argument("--plan", default=None, help="YAML/JSON plan file (default: same resolution "
                   "as DistributedModelWrapper)")
    p.set_defaults(func=_reporting("reshard", _run_reshard))
    return p


def _consolidate_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("src", help="torchtp sharded checkpoint")
    p.add_argument("dst", help="output HF directory (replaced only once fully written)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest safetensors file, e.g. 5GB or 500MB (default 5GB)")
    p.set_defaults(func=_reporting("consolidate", _run_consolidate))
    return p


_RESHARD_EXAMPLES = """examples:
  torchtp reshard ./ckpt-tp2 ./ckpt-tp4 --tp 4     # torchtp checkpoint saved at tp=2 -> tp=4
  torchtp reshard ./my-llama ./ckpt-tp8 --tp 8     # HF directory -> torchtp checkpoint
"""
_CONSOLIDATE_EXAMPLES = """examples:
  torchtp consolidate ./ckpt-tp4 ./hf-model        # loads with plain transformers
  torchtp consolidate ./ckpt-tp4 ./hf-model --max-shard-size 2GB
"""


def add_reshard_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``reshard`` to a parent parser's ``add_subparsers()`` object."""
    return _reshard_args(subparsers.add_parser(
        "reshard", help=_RESHARD_HELP, description=_RESHARD_HELP, epilog=_RESHARD_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter))


def add_consolidate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``consolidate`` to a parent parser's ``add_subparsers()`` object."""
    return _consolidate_args(subparsers.add_parser(
        "consolidate", help=_CONSOLIDATE_HELP, description=_CONSOLIDATE_HELP,
        epilog=_CONSOLIDATE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter))


def _run_reshard(args: argparse.Namespace) -> int:
    from .offline import reshard

    if args.tp < 1:
        raise ValueError(f"--tp must be >= 1, got {args.tp}")
    reshard(args.src, args.dst, args.tp, plan=args.plan)
    return 0


def _run_consolidate(args: argparse.Namespace) -> int:
    from .offline import consolidate

    consolidate(args.src, args.dst, max_shard_size=args.max_shard_size)
    return 0


def _reporting(name: str, body: Any) -> Any:
    """``body(args)`` with a bad checkpoint or argument reported in one line (exit status 2)."""
    def func(args: argparse.Namespace) -> int:
        try:
            return int(body(args))
        except (ValueError, OSError) as err:
            sys.stderr.write(f"torchtp {name}: error: {err}\n")
            return 2
        except Exception as err:  # e.g. transformers rejecting an odd config: still one line
            sys.stderr.write(f"torchtp {name}: error: {type(err).__name__}: {err}\n")
            return 2
    return func


def run(args: argparse.Namespace) -> int:
    """Run a parsed command (``args.func``, set by the ``add_*_parser`` functions)."""
    return int(args.func(args))


def _main(build: Any, prog: str, argv: Sequence[str] | None) -> int:
    parser = build(argparse.ArgumentParser(prog=prog))
    return run(parser.parse_args(argv))


def reshard_main(argv: Sequence[str] | None = None) -> int:
    """``torchtp reshard SRC DST --tp M``; returns the exit status."""
    return _main(_reshard_args, "torchtp reshard", argv)


def consolidate_main(argv: Sequence[str] | None = None) -> int:
    """``torchtp consolidate SRC DST``; returns the exit status."""
    return _main(_consolidate_args, "torchtp consolidate", argv)
