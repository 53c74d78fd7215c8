"""The layout planner's memory per rank against what torchtp allocates, at every layout here.

Every combination of ``pp x dp x cp x tp`` (and ``ep`` for the MoE) up to 8
Gloo processes that torchtp runs, with DDP and FSDP2, sequence parallelism on
and off, full recomputation on and off, 1F1B and GPipe, for a tiny float32
Llama and a tiny Qwen3-MoE: one AdamW step each (measured at the second step),
every rank's parameters, gradients and optimizer state (bytes of its local
tensors) and the peak of the bytes autograd holds saved, beside
``torchtp.planner.rank_memory`` for that rank (tests/distributed/_planner_checks.py).

    .venv/bin/python benchmarks/planner_memory.py [--arch llama,qwen3_moe] [--max-world 8]
        [--quick] [--json out.json]

Prints one row per layout: whether parameters, gradients and optimizer state
matched to the byte on every rank, and the worst ratio measured/predicted
of activations over its ranks.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.distributed import _planner_checks as checks
from tests.distributed.harness import run_ranks


def cases(arch: str, max_world: int, quick: bool) -> list[dict[str, Any]]:
    """Every layout of ``arch`` up to ``max_world`` ranks that torchtp runs."""
    out = []
    for pp, dp, cp, tp in itertools.product((1, 2, 4), (1, 2, 4), (1, 2, 4), (1, 2, 4, 8)):
        if pp * dp * cp * tp > max_world or (pp > 1 and cp > 1 and tp > 1):
            continue  # pp x cp x tp is not composed yet
        eps = [e for e in (1, 2, 4, 8) if tp % e == 0] if arch == "qwen3_moe" else [1]
        kinds = ["ddp", "fsdp"] if dp > 1 else ["ddp"]
        sps = [False, True] if tp > 1 else [False]
        recomputes = [False, True]
        rows = checks.BATCH // dp  # a replica's sequences: microbatches of at least one
        schedules = [(s, m) for s, m in (("1f1b", 2 * pp), ("gpipe", pp)) if m <= rows] \
            if pp > 1 else [("1f1b", 1)]
        if arch == "qwen3_moe":
            sps = [False]  # torchtp's sequence parallelism does not cover the MoE families
        for ep, kind, sp, rec, (sched, m) in itertools.product(eps, kinds, sps, recomputes,
                                                               schedules):
            if quick and ((rec and sp) or (sched == "gpipe" and rec)):
                continue
            if pp > 1 and (rec or sp):
                continue  # recomputation inside a stage is not tested; sp inside one is refused
            out.append(checks.case(arch=arch, pp=pp, dp=dp, cp=cp, tp=tp, ep=ep, sp=sp,
                                   dp_kind=kind, recompute=rec, microbatches=m,
                                   schedule=sched))
    return out


def _world(case: dict[str, Any]) -> int:
    return case["pp"] * case["dp"] * case["cp"] * case["tp"]


def run(all_cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Measure every case, one spawn per world size."""
    rows = []
    for world in sorted({_world(c) for c in all_cases}):
        group = [c for c in all_cases if _world(c) == world]
        print(f"world {world}: {len(group)} layouts ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            got = run_ranks(checks.measure_each, world, group, tmp_path=Path(tmp),
                            timeout=3600)
        print(f"  {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        for i, case in enumerate(group):
            per_rank = [r[i] for r in got]
            errors = [r["error"] for r in per_rank if "error" in r]
            if errors:
                rows.append({"layout": checks.name(case), "ranks": world, "error": errors[0]})
                continue
            exact = all(r["got"][k] == r["want"][k] for r in per_rank
                        for k in ("params", "grads", "optimizer"))
            ratios = [r["got"]["activations"] / r["want"]["activations"] for r in per_rank]
            worst = max(ratios, key=lambda x: abs(x - 1))
            rows.append({"layout": checks.name(case), "ranks": world, "exact": exact,
                         "activations": worst,
                         "params": max(r["got"]["params"] for r in per_rank),
                         "act_bytes": max(r["got"]["activations"] for r in per_rank)})
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    lines = ["| layout | ranks | parameters, gradients, optimizer state | activations "
             "measured / predicted (worst rank) |", "|---|---:|---|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['layout']} | {r['ranks']} | raised: {r['error']} | - |")
            continue
        lines.append(f"| {r['layout']} | {r['ranks']} | "
                     f"{'exact on every rank' if r['exact'] else '**differ**'} | "
                     f"{r['activations']:.3f} |")
    ran = [r for r in rows if "error" not in r]
    exact = sum(r["exact"] for r in ran)
    within = sum(abs(r["activations"] - 1) <= 0.10 for r in ran)
    worst = max(ran, key=lambda r: abs(r["activations"] - 1))
    lines.append("")
    lines.append(f"{len(rows)} layouts ({len(rows) - len(ran)} raised): parameters, gradients "
                 f"and optimizer state exact in {exact}; activations within 10% in {within} "
                 f"(worst {worst['activations']:.3f}, {worst['layout']})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="llama,qwen3_moe")
    ap.add_argument("--max-world", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="fewer flag combinations")
    ap.add_argument("--json")
    args = ap.parse_args()
    all_cases = [c for a in args.arch.split(",") for c in cases(a, args.max_world, args.quick)]
    rows = run(all_cases)
    print(render(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
