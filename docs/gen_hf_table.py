"""Generate the supported-architectures table of docs/hf.md from the tests.

Usage (from the repository root): ``python docs/gen_hf_table.py`` prints the
table; ``python docs/gen_hf_table.py --write`` replaces it in docs/hf.md.
tests/distributed/test_hf_docs.py fails when the page is out of date.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BEGIN, END = "<!-- hf-table:begin -->", "<!-- hf-table:end -->"


def table() -> str:
    """One row per architecture that tests/distributed/test_hf_models.py checks."""
    import torchtp
    from tests.distributed._hf_models import GENERATES, build
    from tests.distributed.test_hf_more_archs import SOURCES
    from tests.distributed.test_hf_models import ARCHS, CHOSEN

    rows = ["| architecture (test config) | model class | plan source (chosen by cost) | styles | "
            "collectives per forward (2 layers) | checked at tp 2 and 4 |",
            "|---|---|---|---|---|---|"]
    for arch in ARCHS:
        wrapped = torchtp.DistributedModelWrapper(build(arch), world_size=2, rank=0)
        plan = wrapped.resolved_plan
        styles = ", ".join(sorted(set(plan.rules.values())))
        counts = ", ".join(f"{n} {op}" for op, n in sorted(CHOSEN[arch].items()))
        checks = "logits, grads, 2 SGD steps" + (", greedy generate" if arch in GENERATES else "")
        rows.append(f"| {arch} | {type(wrapped.base_model).__name__} | {plan.source} | "
                    f"{styles} | {counts} | {checks} |")
    rows += ["", "Also checked at tp=4 by `tests/distributed/test_hf_more_archs.py` (logits, "
             "grads, one SGD step, greedy generation where the model generates):", "",
             "| architecture (test config) | model class | plan source | layers split | kept replicated |",
             "|---|---|---|---|---|"]
    for arch in SOURCES:
        wrapped = torchtp.DistributedModelWrapper(build(arch), world_size=4, rank=0)
        plan = wrapped.resolved_plan
        notes = "; ".join(dict.fromkeys(  # what stays replicated, once per layer pattern
            re.sub(r"kept replicated: splitting it alone .*", "kept replicated by cost "
                   "(split alone it saves less than its collectives cost)",
                   re.sub(r"\.\d+\.", ".*.", n))
            for n in plan.notes if "kept replicated" in n)) or "-"
        rows.append(f"| {arch} | {type(wrapped.base_model).__name__} | {plan.source} | "
                    f"{len(wrapped.parallelized_layers)} | {notes} |")
    return "\n".join(rows + _newer_families())


def _newer_families() -> list[str]:
    """Issue 37's families (tests/distributed/test_hf_new_families.py), parameters per rank
    at tp 2 (rank 0 holds the largest share)."""
    import torchtp
    from tests.distributed._hf_models import build
    from tests.distributed._new_families import build_hybrid
    from tests.distributed.test_hf_new_families import MLA, OLMO

    rows = ["", "Newer decoder families, checked at tp 2, 3 and 4 by "
            "`tests/distributed/test_hf_new_families.py` (logits, every gradient, two SGD steps, "
            "greedy generation):", "",
            "| architecture (test config) | model class | plan source | split by whole heads "
            "| whole, gradient summed | parameters per rank at tp 2 |",
            "|---|---|---|---|---|---:|"]
    for arch in OLMO + MLA:
        model = build(arch)
        full = sum(p.numel() for p in model.parameters())
        wrapped = torchtp.DistributedModelWrapper(model, world_size=2, rank=0)
        plan = wrapped.resolved_plan
        leaf = {n: re.sub(r".*[.]", "", n) for n in plan.assignments}
        shared = sorted({leaf[n] for n, s in plan.assignments.items()
                         if getattr(s, "name", "") == "mla_kv_a_proj"})
        heads = sorted({leaf[n] for n, why in plan.why.items()
                        if "whole heads" in why and leaf[n] not in shared})
        share = sum(p.numel() for p in wrapped.parameters()) / full
        rows.append(f"| {arch} | {type(wrapped.base_model).__name__} | {plan.source} | "
                    f"{', '.join(heads)} | {', '.join(shared) or '-'} | {share:.2f} |")
    rows += _state_space()
    rows += ["", "Hybrid models with experts, checked at tp 3 under `grouped_mm` (logits and "
             "every gradient; their mixers split as in the table above):",
             "", "| architecture (test config) | model class | plan source | experts' features "
             "per rank at tp 3 | parameters per rank at tp 2 |", "|---|---|---|---|---:|"]
    for arch in ("qwen3_next", "jamba"):
        model = build_hybrid(arch)
        full = sum(p.numel() for p in model.parameters())
        wrapped = torchtp.DistributedModelWrapper(model, world_size=2, rank=0)
        share = sum(p.numel() for p in wrapped.parameters()) / full
        features = [next(m.down_proj.shape[-1] for n, m in torchtp.DistributedModelWrapper(
            build_hybrid(arch), world_size=3, rank=r).base_model.named_modules()
            if n.endswith("experts")) for r in range(3)]
        rows.append(f"| {arch} | {type(wrapped.base_model).__name__} | "
                    f"{wrapped.resolved_plan.source} | {'/'.join(map(str, features))} of 32 | "
                    f"{share:.2f} |")
    return rows


def _state_space() -> list[str]:
    """Issue 37's state-space and linear-attention mixers, parameters per rank at tp 2."""
    import torchtp
    from tests.distributed._hf_models import build
    from tests.distributed.test_hf_new_families import SSM
    from torchtp.plans.heads import ssm_geometry

    rows = ["", "State-space and linear-attention mixers, split by heads (or channels) and "
            "checked at tp 2, 3 and 4 by the same test (each split confirmed by the mixer "
            "probe; see [Attention heads](#attention-heads)):", "",
            "| architecture (test config) | model class | plan source | mixer | its parts split "
            "| parameters per rank at tp 2 |", "|---|---|---|---|---|---:|"]
    for arch in SSM:
        model = build(arch)
        full = sum(p.numel() for p in model.parameters())
        kinds = {n: type(m).__name__ for n, m in model.named_modules()}  # before the swap
        mixers = {n for n, m in model.named_modules() if ssm_geometry(m) is not None}
        wrapped = torchtp.DistributedModelWrapper(model, world_size=2, rank=0)
        plan = wrapped.resolved_plan
        first = next(n for n in plan.checks if n in mixers)  # split or kept whole
        parts = sorted({n.removeprefix(f"{first}.") for n in plan.assignments
                        if n.startswith(f"{first}.") and plan.assignments[n].name != "replicate"})
        parts = parts or ["none (kept whole)"]
        share = sum(p.numel() for p in wrapped.parameters()) / full
        rows.append(f"| {arch} | {type(wrapped.base_model).__name__} | {plan.source} | "
                    f"{kinds[first]} | {', '.join(parts)} | "
                    f"{share:.2f} |")
    return rows


if __name__ == "__main__":
    from generated_section import main

    sys.exit(main(sys.argv[1:], table, ROOT / "docs" / "hf.md", BEGIN, END))
