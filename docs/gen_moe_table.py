"""Generate the supported-architectures table of docs/moe.md from the code.

One row per MoE architecture the tests build (``tests/distributed/_moe_checks``):
its classes, the layout flags transformers sets on its experts module, and for
each split what the wrapper plans at 4 ranks (planning only, no process group)
or the first words of the error it raises. Usage (from the repository root):
``python docs/gen_moe_table.py`` prints the table; ``--write`` replaces it in
docs/moe.md. tests/distributed/test_hf_docs.py fails when the page is out of
date for the transformers release it names.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BEGIN, END = "<!-- moe-table:begin -->", "<!-- moe-table:end -->"
SPLITS = {"features split (default)": {},
          "whole experts (`expert_parallel=True`)": {"expert_parallel": True},
          "ep 2 x tp 2 (`expert_parallel=2`)": {"expert_parallel": 2}}


def _verdict(arch: str, options: dict[str, Any]) -> str:
    """What the wrap plans for layer 0's experts at 4 ranks, or why it refuses."""
    from tests.distributed._moe_checks import build_moe

    import torchtp

    try:
        wrapped = torchtp.DistributedModelWrapper(build_moe(arch), world_size=4, rank=0,
                                                  **options)
    except ValueError as err:
        reason = str(err).split(": ", 2)[-1].split(";")[0].split(", so")[0]
        return f"refused ({reason})"
    layer = wrapped.resolved_plan.layers.get("model.layers.0.mlp.experts")
    if layer is None or not layer.layouts:
        return "kept whole"
    return f"`{layer.style}` {layer.full} -> {layer.local}"


def table() -> str:
    """The table, headed by the transformers release it was generated with."""
    import transformers
    from tests.distributed._moe_checks import ARCHS, build_moe

    from torchtp.hf.compat import experts_flags

    rows = [f"Generated with transformers {transformers.__version__} "
            "(`python docs/gen_moe_table.py --write`); parameter shapes of layer 0's "
            "experts module `(E, 2I, H)`, full -> rank 0's of 4.", "",
            "| architecture (test config) | model class | experts class | layout flags | "
            + " | ".join(SPLITS) + " |",
            "|---|---|---|---|" + "---|" * len(SPLITS)]
    for arch in [*ARCHS, "gpt_oss"]:
        model = build_moe(arch)
        experts = model.model.layers[0].mlp.experts
        flags = experts_flags(experts) or {}
        shown = ", ".join(k for k, v in flags.items() if v) or "-"
        verdicts = " | ".join(_verdict(arch, options) for options in SPLITS.values())
        rows.append(f"| {arch} | {type(model).__name__} | {type(experts).__name__} | {shown} | "
                    f"{verdicts} |")
    return "\n".join(rows)


if __name__ == "__main__":
    from generated_section import main

    sys.exit(main(sys.argv[1:], table, ROOT / "docs" / "moe.md", BEGIN, END))
