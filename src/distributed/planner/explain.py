"""Why the planner's choice wins and each runner-up loses, in words, and the ranked table."""

from __future__ import annotations

from .search import Candidate

GB = 1e9
_MEMORY = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state",
           "activations": "activations", "transient": "working memory",
           "buffers": "communication buffers"}
_PARTS = ("compute", "tp", "cp", "ep", "pp", "bubble", "dp", "optimizer")
_NAMES = {"compute": "compute", "tp": "tensor-parallel collectives",
          "cp": "context-parallel K/V exchanges", "ep": "expert all-to-alls",
          "pp": "pipeline sends", "bubble": "pipeline bubble",
          "dp": "exposed data-parallel collectives", "optimizer": "optimizer step"}


def describe(c: Candidate) -> str:
    """``"pp 2 x dp 4 x tp 8, 1f1b x 16, recompute"``: a candidate in a few words."""
    layout = c.layout
    parts = [layout.short()]
    if layout.pp > 1:
        v = f" v{layout.stages_per_rank}" if layout.schedule == "interleaved1f1b" else ""
        parts.append(f"{layout.schedule}{v} x {layout.microbatches}")
        if layout.stage_layers:
            parts.append("layers " + "/".join(map(str, sorted(set(layout.stage_layers)))))
    if c.recompute:
        parts.append("recompute")
    return ", ".join(parts)


def why_loses(c: Candidate, best: Candidate, memory: float) -> str:
    """One sentence: what makes ``c`` worse than ``best``."""
    if not c.fits:
        part = max(_MEMORY, key=lambda k: getattr(c.memory, k))
        return (f"does not fit: {c.memory.total / GB:.1f} GB per rank > {memory / GB:.0f} GB "
                f"({_MEMORY[part]} {getattr(c.memory, part) / GB:.1f} GB)")
    if not c.runs:
        return f"planned only: {c.why}"
    slower = c.time.total / best.time.total - 1
    grew = max(_PARTS, key=lambda k: getattr(c.time, k) - getattr(best.time, k))
    delta = getattr(c.time, grew) - getattr(best.time, grew)
    return (f"{slower:+.0%} step time: {_NAMES[grew]} {getattr(c.time, grew):.3g} s "
            f"({delta:+.3g} s against the winner's)")


def why_wins(best: Candidate, memory: float) -> str:
    """One sentence: what the winner's step is made of."""
    t = best.time
    top = sorted(_PARTS, key=lambda k: -getattr(t, k))[:3]
    spent = ", ".join(f"{_NAMES[k]} {getattr(t, k) / t.total:.0%}" for k in top if getattr(t, k))
    return (f"winner: {describe(best)}: {t.total:.3g} s a step, {t.tokens_per_s:,.0f} tokens/s, "
            f"MFU {t.mfu:.0%}; {best.memory.total / GB:.1f} of {memory / GB:.0f} GB per rank; "
            f"time in {spent}")


def table(ranked: list[Candidate], memory: float, top: int = 10) -> str:
    """The first ``top`` candidates as a text table, the winner's reason and the runners-up's."""
    head = ("rank", "layout", "memory GB (p/g/o/act)", "fits", "step s", "tokens/s", "MFU",
            "torchtp")
    rows = [head]
    for i, c in enumerate(ranked[:top], 1):
        m = c.memory
        rows.append((str(i), describe(c),
                     f"{m.total / GB:.1f} ({m.params / GB:.1f}/{m.grads / GB:.1f}/"
                     f"{m.optimizer / GB:.1f}/{m.activations / GB:.1f})",
                     "yes" if c.fits else "no", f"{c.time.total:.3g}",
                     f"{c.time.tokens_per_s:,.0f}", f"{c.time.mfu:.0%}",
                     "runs" if c.runs else "planned only"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    best = ranked[0]
    lines += ["", why_wins(best, memory)]
    lines += [f"  #{i} {describe(c)}: {why_loses(c, best, memory)}"
              for i, c in enumerate(ranked[1:top], 2)]
    return "\n".join(lines)
