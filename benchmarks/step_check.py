"""What the optimizer-step check of replicated state costs per training step.

One run, 2 Gloo CPU processes (one thread each), tp 2: a small Llama (hidden
256, 4 layers, 8 heads, ffn 704, vocab 8000) wrapped with its default plan
(``DistributedModelWrapper(model)``: embedding and LM head split too; with
``--replicated-embeddings`` only the decoder layers, so 4.1M replicated
elements per rank are digested), twice in the same processes: once with
the check on (``TP_STEP_CHECK`` unset: gradients every step, weights every 10
steps) and once off (``TP_STEP_CHECK=0`` while wrapping). A step is forward +
backward + ``torchtp.clip_grad_norm_`` + AdamW. The two variants run in
interleaved repetitions (barrier before every step); per repetition the wall
time of the slower rank, medians over repetitions. The check alone is also
timed directly (``step_check.check`` on the optimizer's plan, gradients only
and gradients + weights), because the difference of two step medians on a busy
machine is mostly noise. Target: the check <= 1% of the step.

    .venv/bin/python benchmarks/step_check.py --reps 30
    .venv/bin/python benchmarks/step_check.py --reps 30 --replicated-embeddings
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _llama import HF_PLAN, build_llama
from torchtp.cli._launch import launch

SIZE = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 8, "intermediate_size": 704, "vocab_size": 8000}
BATCH, SEQ = 4, 128


def _stepper(check: bool, plan: Any) -> tuple[Any, Any, torch.optim.Optimizer]:
    import torchtp

    os.environ["TP_STEP_CHECK"] = "10" if check else "0"
    model = torchtp.DistributedModelWrapper(build_llama(**SIZE).train(), plan=plan)
    os.environ.pop("TP_STEP_CHECK")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, SIZE["vocab_size"], (BATCH, SEQ), generator=torch.Generator()
                        .manual_seed(0))

    def step() -> float:
        dist.barrier()
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        torchtp.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep grads for the direct timing below
        return time.perf_counter() - start

    return step, model, opt


def _direct(opt: torch.optim.Optimizer, weights: bool, reps: int = 50) -> float:
    """Median seconds of one check of ``opt``'s plan (barrier before each)."""
    from torchtp.guards import step_check

    (plan,) = step_check._plans(opt)
    times = []
    for _ in range(reps):
        plan.steps = 0 if weights else 1
        dist.barrier()
        start = time.perf_counter()
        step_check.check(plan)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rank(rank: int, world: int, reps: int, plan: Any) -> dict[str, Any]:
    import torchtp
    from torchtp.guards import step_check

    warnings.filterwarnings("ignore")
    torchtp.init_tensor_parallel(tp_size=2)
    steps = {"on": _stepper(True, plan), "off": _stepper(False, plan)}
    for step, _, _ in steps.values():
        step()  # warm-up
    wall: dict[str, list[float]] = {n: [] for n in steps}
    names = list(steps)
    for rep in range(reps):
        for name in names[rep % 2:] + names[:rep % 2]:
            wall[name].append(steps[name][0]())
    opt = steps["on"][2]
    (plan,) = step_check._plans(opt)
    return {"wall": wall, "grads": _direct(opt, False), "both": _direct(opt, True),
            "params": len(plan.params), "elements": sum(p.numel() for p in plan.params),
            "total": sum(p.numel() for p in steps["on"][1].parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=30, help="interleaved repetitions")
    parser.add_argument("--replicated-embeddings", action="store_true",
                        help="plan only the decoder layers (benchmarks/_llama.py HF_PLAN): the "
                             "embedding and LM head stay replicated, so the check reads them")
    args = parser.parse_args()
    load_before = os.getloadavg()
    plan = HF_PLAN if args.replicated_embeddings else None
    per_rank = launch(_rank, 2, args.reps, plan, timeout=3600)
    load_after = os.getloadavg()
    ms = {n: statistics.median(max(ts) for ts in zip(*[r["wall"][n] for r in per_rank],
                                                    strict=True)) * 1e3 for n in ("on", "off")}
    grads = max(r["grads"] for r in per_rank) * 1e3
    both = max(r["both"] for r in per_rank) * 1e3
    per_step = grads + (both - grads) / 10  # weights every 10th step
    r0 = per_rank[0]
    print(f"tp 2, 2 Gloo CPU processes x 1 thread, batch {BATCH} x seq {SEQ}, {args.reps} "
          f"interleaved reps; replicated: {r0['params']} parameters, {r0['elements']} of "
          f"{r0['total']} elements per rank; load average {load_before[0]:.1f} -> "
          f"{load_after[0]:.1f} on {os.cpu_count()} cores")
    print("| measure | ms | % of step (check off) |")
    print("|---|---:|---:|")
    off = ms["off"]
    rows = [("step, check off (median)", off), ("step, check on (median)", ms["on"]),
            ("difference of medians", ms["on"] - off), ("check: gradients only", grads),
            ("check: gradients + weights", both), ("check: mean per step (weights 1 in 10)",
                                                   per_step)]
    for label, value in rows:
        print(f"| {label} | {value:.3f} | {100 * value / off:.2f}% |")


if __name__ == "__main__":
    main()
