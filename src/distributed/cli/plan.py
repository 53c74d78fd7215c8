"""``torchtp plan PATH --tp N``: the resolved plan, memory per rank and blockers.

Everything happens on the meta device: no weights are read and no process
group is started.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import replace
from typing import Any

from torch import nn

from ..ep.dispatch import Dispatch
from ..plans import ResolvedPlan, ShardContext, resolve_plan, valid_tp_sizes
from ..training.options import Options
from . import layout
from ._common import (
    PLAN_HELP,
    CliError,
    add_expert_options,
    dump_json,
    human_bytes,
    plan_choice,
    positive_int,
    table,
)
from ._hf import build_model, load_config, parse_dtype

HELP = ("show the TP plan, per-rank memory and blockers (--tp), or the ranked training "
        "layouts on a cluster (--gpus); meta device, no weights read")
EXAMPLES = """examples:
  torchtp plan ./Llama-3.2-1B --tp 2
  torchtp plan ./Llama-3.1-70B --gpus 64 --global-batch 256 --seq 8192 --out layout.json
  torchtp plan llama3-405b --gpus 8192 --hardware h100-80gb --global-batch 2048 --seq 8192
  torchtp plan ./Llama-3.2-1B/config.json --tp 4 --json
  torchtp plan ./Phi-3-mini --tp 2 --plan builtin     # torchtp's packed plan, as written
  torchtp plan ./Llama-3.2-1B --tp 2 --plan auto-memory   # the least memory per rank
  torchtp plan ./Mixtral-8x7B --tp 8 --expert-parallel 4   # experts over 4 x features over 2
exit status: 0 when the model splits at --tp (or a layout fits, with --gpus), 1 when there
are blockers (or none fits), 2 on bad input
"""


def register(sub: Any) -> None:
    """Add the ``plan`` subcommand to ``sub`` (an argparse subparsers object)."""
    p = sub.add_parser("plan", help=HELP, description=HELP, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="HuggingFace model directory or its config.json (with --gpus "
                   f"also a published model: {', '.join(sorted(layout.KNOWN))})")
    p.add_argument("--tp", type=positive_int, help="tensor-parallel size: show its plan")
    p.add_argument("--dtype", default=None, help="parameter dtype (default: the config's, else float32)")
    p.add_argument("--plan", type=plan_choice, default=None, metavar="auto|auto-memory|builtin|FILE",
                   help=PLAN_HELP)
    add_expert_options(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    layout.add_options(p)
    p.set_defaults(run=run)


def analyze(path: str, tp: int, dtype_name: str | None = None, plan: str | None = None,
            expert_parallel: bool | int = False,
            expert_dispatch: Dispatch = "auto") -> dict[str, Any]:
    """The plan report as data (used by ``plan``, ``verify``, ``bench`` and ``demo``).

    Resolves the plan as ``DistributedModelWrapper(model, expert_parallel=...,
    expert_dispatch=...)`` does (:func:`torchtp.plans.resolve_plan` with the
    wrapper's option edits), on a meta-device model, but collects every blocker
    instead of stopping at the first; the wrapper's strict check has the last
    word, so ``plan`` never says "works" where the wrapper would refuse.
    """
    config = load_config(path)
    dtype = parse_dtype(dtype_name, config)
    model = build_model(config, dtype, device="meta")
    ctx = ShardContext(tp, 0, None, type(model).__name__)
    adjust = Options(False, False, expert_parallel, expert_dispatch).adjust
    try:
        resolved = resolve_plan(model, plan, ctx, strict=False, adjust=adjust)
    except (TypeError, ValueError) as err:
        raise CliError(f"{path}: torchtp cannot plan this model: {err}") from None
    blockers = [str(err) for err in resolved.problems]
    layers, layouts, found = _layers(model, resolved, ctx)
    blockers += found
    if not blockers:
        try:
            resolve_plan(model, plan, ctx, adjust=adjust)
        except (TypeError, ValueError) as err:
            blockers = [str(err)]
    full, by_rank = _param_bytes(model, layouts, tp)
    collectives = resolved.collectives()
    return {"path": str(path), "model_type": config.model_type, "tp": tp, "dtype": str(dtype),
            "plan_source": resolved.source, "plan": resolved.rules, "layers": layers,
            "param_bytes_unsharded": full, "param_bytes_per_rank": max(by_rank),
            "param_bytes_by_rank": by_rank,
            "collectives_per_forward": dict(collectives),
            "blockers": list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", b) for b in blockers)),
            "valid_tp_sizes": valid_tp_sizes(resolved.constraints), "notes": resolved.notes,
            "choice": resolved.choice.lines() if resolved.choice is not None else []}


def _layers(model: nn.Module, resolved: ResolvedPlan, ctx: ShardContext
            ) -> tuple[list[dict[str, Any]], dict[str, list[Any]], list[str]]:
    """Per-module rows, every rank's parameter layouts and the failing constraints.

    Shares may differ by a row or a head between ranks (balanced split), so
    each module is planned for every rank: ``local`` is rank 0's weight shape,
    ``local_per_rank`` every rank's.
    """
    modules = dict(model.named_modules())
    layers: list[dict[str, Any]] = []
    layouts: dict[str, list[Any]] = {}
    blockers: list[str] = []
    for name, layer in resolved.layers.items():
        failing = [c.problem(ctx.world_size) for c in layer.constraints
                   if not c.ok(ctx.world_size)]
        blockers += failing
        if failing:
            continue  # shapes and layouts are undefined at this tp size
        style = resolved.assignments[name]
        plans = [layer] + [style.plan(modules[name], name, replace(ctx, rank=r))
                           for r in range(1, ctx.world_size)]
        layers.append({"module": name, "style": layer.style, "full": list(layer.full),
                       "local": list(layer.local),
                       "local_per_rank": [list(p.local) for p in plans]})
        for p in layer.layouts:
            layouts[f"{name}.{p}"] = [rank_plan.layouts[p] for rank_plan in plans]
    return layers, layouts, blockers


def _param_bytes(model: nn.Module, layouts: dict[str, list[Any]], tp: int
                 ) -> tuple[int, list[int]]:
    """(unsharded, per-rank list) parameter bytes; tied parameters count once."""
    full, by_rank = 0, [0] * tp
    for name, p in model.named_parameters():
        full += p.numel() * p.element_size()
        per_rank = layouts.get(name)
        for r in range(tp):
            shape = per_rank[r].local_shape if per_rank is not None else tuple(p.shape)
            by_rank[r] += math.prod(shape) * p.element_size()
    return full, by_rank


def _shapes(row: dict[str, Any]) -> str:
    """The local weight shape, or every rank's in rank order when they differ.

    ``a/b/c`` up to 4 ranks; beyond, runs of equal shapes as ``shape*ranks``
    (``114x256*7/113x256*2``).
    """
    shapes = ["x".join(map(str, s)) for s in row.get("local_per_rank", [row["local"]])]
    if len(set(shapes)) == 1:
        return shapes[0]
    if len(shapes) <= 4:
        return "/".join(shapes)
    runs: list[list[Any]] = []
    for shape in shapes:
        if runs and runs[-1][0] == shape:
            runs[-1][1] += 1
        else:
            runs.append([shape, 1])
    return "/".join(f"{shape}*{n}" if n > 1 else shape for shape, n in runs)


def _grouped(layers: list[dict[str, Any]]) -> list[list[Any]]:
    """One row per (module pattern with layer numbers as '*', style, shapes)."""
    groups: dict[tuple[str, str, str, str], int] = {}
    for row in layers:
        key = (re.sub(r"\.\d+\.", ".*.", row["module"]), row["style"],
               "x".join(map(str, row["full"])), _shapes(row))
        groups[key] = groups.get(key, 0) + 1
    return [[*k[:2], n, *k[2:]] for k, n in groups.items()]


def render(report: dict[str, Any]) -> str:
    """The report as readable text."""
    out = [f"model: {report['path']} ({report['model_type']}), tp={report['tp']}, "
           f"dtype={report['dtype']}",
           table(["module", "style", "count", "full weight", "local weight (per rank)"],
                 _grouped(report["layers"])),
           f"plan source: {report['plan_source']}; modules not listed are replicated",
           f"parameters: {human_bytes(report['param_bytes_per_rank'])} per rank (largest) vs "
           f"{human_bytes(report['param_bytes_unsharded'])} unsharded "
           f"({report['param_bytes_per_rank'] / max(report['param_bytes_unsharded'], 1):.0%})",
           "collectives per forward: " + (", ".join(
               f"{n} x {op}" for op, n in report["collectives_per_forward"].items()) or "none"),
           f"valid tp sizes for this model: {report['valid_tp_sizes']}"]
    out += report["choice"]
    out += [f"note: {n}" for n in report["notes"]]
    if report["blockers"]:
        out.append(f"BLOCKERS at tp={report['tp']} ({len(report['blockers'])}):")
        out += [f"  - {b}" for b in report["blockers"]]
    else:
        out.append(f"no blockers: tp={report['tp']} works")
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    """Print the plan (``--tp``) or the layouts (``--gpus``); exit status 1 when there are
    blockers or no layout fits."""
    if (args.tp is None) == (args.gpus is None):
        raise CliError("give --tp N (the tensor-parallel plan) or --gpus N (the training "
                       "layouts), one of them")
    if args.gpus is not None:
        return layout.run(args)
    report = analyze(args.path, args.tp, args.dtype, args.plan, args.expert_parallel,
                     args.expert_dispatch)
    print(dump_json(report) if args.json else render(report))
    return 1 if report["blockers"] else 0


def require_splittable(path: str, tp: int, dtype_name: str | None, plan: str | None = None,
                       experts: dict[str, Any] | None = None) -> None:
    """Fail fast, before any process starts, when ``tp`` cannot split the model.

    Raises:
        CliError: the first blocker, how many more, and the valid tp sizes.
    """
    report = analyze(path, tp, dtype_name, plan, **(experts or {}))
    blockers = report["blockers"]
    if blockers:
        more = f" (and {len(blockers) - 1} more)" if len(blockers) > 1 else ""
        raise CliError(f"tp={tp} cannot split {path}: {blockers[0]}{more}; valid tp sizes: "
                       f"{report['valid_tp_sizes']}; run `torchtp plan {path} --tp {tp}` for the list")
