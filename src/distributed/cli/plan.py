"""``torchtp plan PATH --tp N``: the resolved plan, memory per rank and blockers.

Everything happens on the meta device: no weights are read and no process
group is started.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from typing import Any

from torch import nn

from ..errors import valid_sizes
from ..plans import ShardContext, match_plan
from ._common import dump_json, human_bytes, positive_int, table
from ._hf import build_model, head_blockers, head_dims, hf_plan, load_config, parse_dtype

HELP = "show the TP plan, per-rank memory and blockers (meta device, no weights read)"
EXAMPLES = """examples:
  torchtp plan ./Llama-3.2-1B --tp 2
  torchtp plan ./Llama-3.2-1B/config.json --tp 4 --json
"""
# Collectives one forward of a module in each style issues.
_COLLECTIVES = {"rowwise": "all_reduce", "rowwise_split_input": "all_reduce",
                "colwise_gather_output": "all_gather"}


def register(sub: Any) -> None:
    """Add the ``plan`` subcommand to ``sub`` (an argparse subparsers object)."""
    p = sub.add_parser("plan", help=HELP, description=HELP, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="HuggingFace model directory or its config.json")
    p.add_argument("--tp", type=positive_int, required=True, help="tensor-parallel size")
    p.add_argument("--dtype", default=None, help="parameter dtype (default: the config's, else float32)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(run=run)


def analyze(path: str, tp: int, dtype_name: str | None = None) -> dict[str, Any]:
    """The plan report as data (used by ``plan``, ``verify`` and ``demo``)."""
    config = load_config(path)
    dtype = parse_dtype(dtype_name, config)
    model = build_model(config, dtype, device="meta")
    plan = hf_plan(config, model)
    resolved = match_plan(model, plan, "config.base_model_tp_plan")
    ctx = ShardContext(tp, 0, None)
    modules = dict(model.named_modules())
    layers, blockers, split_dims = [], head_blockers(config, tp), head_dims(config)
    for name, style in resolved.assignments.items():
        mod = modules[name]
        try:
            style.validate(mod, name, ctx)
        except (TypeError, ValueError) as err:
            blockers.append(str(err))
        if isinstance(mod, nn.Linear):
            split_dims.append(mod.out_features if style.name.startswith("colwise") else mod.in_features)
        shapes = style.shapes(mod, ctx)
        layers.append({"module": name, "style": style.name, "full": list(shapes.full),
                       "local": list(shapes.local)})
    full, local = _param_bytes(model, resolved.assignments, tp)
    collectives = Counter(_COLLECTIVES[s.name] for s in resolved.assignments.values()
                          if s.name in _COLLECTIVES)
    return {"path": str(path), "model_type": config.model_type, "tp": tp, "dtype": str(dtype),
            "plan": plan, "layers": layers, "param_bytes_unsharded": full,
            "param_bytes_per_rank": local, "collectives_per_forward": dict(collectives),
            "blockers": list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", b) for b in blockers)),
            "valid_tp_sizes": valid_sizes(*split_dims),
            "notes": resolved.notes}


def _param_bytes(model: nn.Module, assignments: dict[str, Any], tp: int) -> tuple[int, int]:
    """(unsharded, per-rank) parameter bytes; tied parameters count once."""
    full = local = 0
    for mod_name, mod in model.named_modules():
        style = assignments.get(mod_name)
        for pname, p in mod.named_parameters(recurse=False):
            nbytes = p.numel() * p.element_size()
            full += nbytes
            split = style is not None and (style.name.startswith("colwise") or (pname == "weight"
                                           and style.name.startswith("rowwise")))
            local += nbytes // tp if split else nbytes
    return full, local


def _grouped(layers: list[dict[str, Any]]) -> list[list[Any]]:
    """One row per (module pattern with layer numbers as '*', style, shapes)."""
    groups: dict[tuple[str, str, str, str], int] = {}
    for row in layers:
        key = (re.sub(r"\.\d+\.", ".*.", row["module"]), row["style"],
               "x".join(map(str, row["full"])), "x".join(map(str, row["local"])))
        groups[key] = groups.get(key, 0) + 1
    return [[*k[:2], n, *k[2:]] for k, n in groups.items()]


def render(report: dict[str, Any]) -> str:
    """The report as readable text."""
    out = [f"model: {report['path']} ({report['model_type']}), tp={report['tp']}, "
           f"dtype={report['dtype']}",
           table(["module", "style", "count", "full weight", "local weight"],
                 _grouped(report["layers"])),
           "all other parameters are replicated (embeddings, norms, lm_head)",
           f"parameters: {human_bytes(report['param_bytes_per_rank'])} per rank vs "
           f"{human_bytes(report['param_bytes_unsharded'])} unsharded "
           f"({report['param_bytes_per_rank'] / max(report['param_bytes_unsharded'], 1):.0%})",
           "collectives per forward: " + (", ".join(
               f"{n} x {op}" for op, n in report["collectives_per_forward"].items()) or "none"),
           f"valid tp sizes for this model: {report['valid_tp_sizes']}"]
    out += [f"note: {n}" for n in report["notes"]]
    if report["blockers"]:
        out.append(f"BLOCKERS at tp={report['tp']} ({len(report['blockers'])}):")
        out += [f"  - {b}" for b in report["blockers"]]
    else:
        out.append(f"no blockers: tp={report['tp']} works")
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    """Print the plan; exit status 1 when there are blockers."""
    report = analyze(args.path, args.tp, args.dtype)
    print(dump_json(report) if args.json else render(report))
    return 1 if report["blockers"] else 0
