"""Generate the validation table of docs/planning.md: published runs beside the planner.

One row per run of ``torchtp.planner.published.runs()``: the layout, what was
reported, what the planner predicts for that layout, the predicted memory per
rank, and the planner's own choice for the same model, GPUs and step.
Usage (from the repository root): ``python docs/gen_planning_table.py`` prints
the table; ``--write`` replaces it in docs/planning.md.
tests/distributed/test_hf_docs.py fails when the page is out of date.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BEGIN, END = "<!-- planning-table:begin -->", "<!-- planning-table:end -->"


def _figure(metric: str, value: float) -> str:
    return f"{value:,.0f} tok/s/GPU" if metric == "tokens" else f"{value:.1%}"


def table() -> str:
    """The table as markdown."""
    from torchtp.planner import published as pub

    names = {"megatron": "Megatron eq. 3 / peak", "mfu": "MFU", "tokens": "tokens/s per GPU"}
    lines = ["| run | GPUs | published layout | metric | reported | predicted | error | "
             "memory GB/rank | fits 80 GB | planner's choice (predicted step) | published "
             "layout's rank |", "|---|---:|---|---|---:|---:|---:|---:|---|---|---:|"]
    for run in pub.runs():
        found = pub.check(run)
        calibrated = " (calibration)" if run.name in pub.CALIBRATION.values() else ""
        lines.append(
            f"| {run.name}{calibrated} | {run.gpus:,} | {run.layout.short()} | "
            f"{names[run.metric]} | {_figure(run.metric, run.reported)} | "
            f"{_figure(run.metric, found.predicted)} | {found.error:+.0%} | "
            f"{found.memory_gb:.1f} | {'yes' if found.fits else '**no**'} | "
            f"{found.best.short()} ({found.best_time:.3g} s; published {found.time.total:.3g} s) | "
            f"{found.published_rank or '-'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    from generated_section import main

    sys.exit(main(sys.argv, table, ROOT / "docs" / "planning.md", BEGIN, END))
