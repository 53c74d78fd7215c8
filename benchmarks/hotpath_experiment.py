"""How much of torchtp's gap to the floor is Python work on the inference path?

Times, interleaved in one run, the hand-written floor, torchtp as shipped, and
torchtp with a proposed inference fast path (monkeypatched here, not in the
library): when no gradient can flow, RowParallelLinear runs only ``F.linear``
and ColumnParallelLinear only ``F.linear`` + ``_comm.all_reduce_`` (no
autograd Function, no input check). Prints medians of the slowest rank and
ratios to the floor for tp 2 and 4, decode and prefill.

    .venv/bin/python benchmarks/hotpath_experiment.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _llama import SMALL
from _variants import floor_model, torchtp_model
from torchtp.cli._launch import launch
from torchtp.comm import ops as _comm
from torchtp.layers import ColumnParallelLinear, RowParallelLinear

REPS = 40


def fast_path(model: torch.nn.Module) -> torch.nn.Module:
    """Replace each parallel layer's forward by its grad-free minimum (experiment only)."""
    for mod in model.modules():
        if isinstance(mod, RowParallelLinear):
            mod.forward = lambda x, m=mod: F.linear(x, m.weight, m.bias)  # (..., out/tp)
        elif isinstance(mod, ColumnParallelLinear):
            def forward(x: torch.Tensor, m: ColumnParallelLinear = mod) -> torch.Tensor:
                y = _comm.all_reduce_(F.linear(x, m.weight), m.group)  # (..., out)
                return y if m.bias is None else y + m.bias
            mod.forward = forward
    return model


def _step(model: torch.nn.Module, ids: torch.Tensor, phase: str) -> Any:
    if phase == "prefill":
        return lambda: model(ids, use_cache=False)
    out = model(ids, use_cache=True)
    token, cache = out.logits[:, -1:].argmax(-1), out.past_key_values  # token: (1, 1)

    def decode() -> None:
        model(token, past_key_values=cache, use_cache=True)
        cache.crop(-1)  # keep the context at 128 tokens

    return decode


def _rank(rank: int, world: int, phase: str) -> dict[str, list[float]]:
    ids = torch.randint(0, SMALL["vocab_size"], (1, 128), generator=torch.Generator().manual_seed(1))
    models = {"floor": floor_model(rank, world), "torchtp": torchtp_model(),
              "torchtp_fastpath": fast_path(torchtp_model())}
    times: dict[str, list[float]] = {n: [] for n in models}
    with torch.inference_mode():
        steps = {n: _step(m, ids, phase) for n, m in models.items()}
        for step in steps.values():
            step()  # warm-up
        names = list(models)
        for rep in range(REPS):
            for name in names[rep % 3:] + names[:rep % 3]:
                dist.barrier()
                start = time.perf_counter()
                steps[name]()
                times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    print("| tp | phase | floor ms | torchtp ms (x floor) | fast path ms (x floor) |\n|---|---|---|---|---|")
    for world in (2, 4):
        for phase in ("decode", "prefill"):
            per_rank = launch(_rank, world, phase, timeout=900)
            med = {n: statistics.median(max(ts) for ts in zip(*(r[n] for r in per_rank), strict=True)) * 1e3
                   for n in per_rank[0]}
            f = med["floor"]
            print(f"| {world} | {phase} | {f:.2f} | {med['torchtp']:.2f} ({med['torchtp'] / f:.2f}) | "
                  f"{med['torchtp_fastpath']:.2f} ({med['torchtp_fastpath'] / f:.2f}) |", flush=True)


if __name__ == "__main__":
    main()
