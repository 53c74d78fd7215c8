"""What every subcommand shares: user errors, progress lines, tables, JSON."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any


class CliError(Exception):
    """A user-facing error: printed as ``torchtp: error: <message>``, exit status 2."""


def progress(message: str) -> None:
    """Tell the user what a long step is doing (stderr, so ``--json`` stays clean)."""
    print(f"[torchtp {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table with left-aligned text and right-aligned numbers."""
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(isinstance(row[i], (int, float)) for row in rows) and rows
               for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(c.rjust(w) if numeric[i] else c.ljust(w)
                         for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e-3 and value else f"{value:,.3f}".rstrip("0").rstrip(".")
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def dump_json(data: Any) -> str:
    """Stable, indented JSON for ``--json``."""
    return json.dumps(data, indent=2, sort_keys=False, default=str)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 with a clear message otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise _arg_error(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise _arg_error(f"expected a positive integer, got {value}")
    return value


def int_list(text: str) -> list[int]:
    """argparse type: ``"1,2,4"`` -> ``[1, 2, 4]`` (each >= 1)."""
    return [positive_int(part) for part in text.split(",") if part.strip()]


def _arg_error(message: str) -> Exception:
    import argparse

    return argparse.ArgumentTypeError(message)


def plan_choice(text: str) -> str | None:
    """argparse type for ``--plan``: ``auto`` (None), ``auto-memory``, ``builtin``, or a plan file."""
    from pathlib import Path

    if text == "auto":
        return None
    if text in ("builtin", "auto-memory") or Path(text).is_file():
        return text
    raise _arg_error(f"expected auto, auto-memory, builtin or a plan file (YAML/JSON), got "
                     f"{text!r}: no such file")


PLAN_HELP = ("which plan: auto (as DistributedModelWrapper(model): the cheapest of the model's HF "
             "plan, torchtp's built-in plan and the automatic dataflow plan, chosen by cost), "
             "auto-memory (the one with the least memory per rank), builtin (torchtp's plan for "
             "the architecture), or a YAML/JSON plan file (default: auto)")


def add_expert_options(p: Any) -> None:
    """``--expert-parallel`` and ``--expert-dispatch`` (MoE models; see docs/moe.md)."""
    from ..ep.dispatch import DISPATCH

    p.add_argument("--expert-parallel", type=expert_parallel_arg, default=False, metavar="true|K",
                   help="MoE models: whole experts per rank (true) or experts over K ranks x "
                        "features over tp/K (as DistributedModelWrapper(expert_parallel=...))")
    p.add_argument("--expert-dispatch", choices=DISPATCH,
                   default="auto", help="with whole experts: how tokens reach them (default auto)")


def expert_parallel_arg(text: str) -> bool | int:
    """argparse type for ``--expert-parallel``: ``true`` or a positive integer."""
    return True if text.lower() == "true" else positive_int(text)


def experts_of(args: Any) -> dict[str, Any]:
    """The wrapper's expert options from parsed arguments (defaults where a command has none)."""
    return {"expert_parallel": getattr(args, "expert_parallel", False),
            "expert_dispatch": getattr(args, "expert_dispatch", "auto")}


def add_rank_options(p: Any) -> None:
    """Options every command that launches rank processes shares (``verify``, ``bench``)."""
    p.add_argument("--dtype", default=None,
                   help="float32 (default for CPU), bfloat16, float16, float64")
    p.add_argument("--plan", type=plan_choice, default=None, metavar="auto|auto-memory|builtin|FILE",
                   help=PLAN_HELP)
    add_expert_options(p)
    p.add_argument("--seed", type=int, default=0, help="seed for random weights and tokens")
    p.add_argument("--backend", default="auto", help="auto (nccl with one GPU per rank, else gloo)")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds (default 600)")
    p.add_argument("--json", action="store_true", help="print JSON")
