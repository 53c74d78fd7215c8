"""Per-call cost of torchtp's default-on guards: a small-batch forward against the floor and DTensor.

Issue 21's measure: a small-batch forward (``--batch`` x ``--tokens``, no KV
cache, ``torch.no_grad``) of benchmarks/_llama.py's small Llama at tp 2 on
Gloo (one thread per rank), in one run, interleaved: the hand-written
plain-tensor floor (sliced weights, one ``dist.all_reduce`` per weight-column
split), torchtp with every default guard, torchtp with one per-call guard
left out at a time, and PyTorch DTensor TP with the same plan. Every round
times each variant once (order rotated; a barrier before every call; the
slowest rank's time); the table gives the median over rounds, the ratio to
the floor and to DTensor, and what each guard costs (torchtp minus torchtp
without it) in microseconds and percent of torchtp's forward.

A guard is left out by building a wrapper with its per-call part not
installed (``hooks.PER_CALL`` lists them); nothing else changes, so the
difference is the guard's own per-call work.

    .venv/bin/python benchmarks/percall_guards.py [--rounds 15] [--batch 2] [--tokens 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _llama import HF_PLAN, SMALL, build_llama
from _variants import dtensor_model, floor_model
from torchtp.cli._launch import launch


def _without(guard: str) -> torch.nn.Module:
    """torchtp's wrapper with the per-call part of ``guard`` not installed."""
    import torchtp
    from torchtp import hooks

    skip = set(hooks.PER_CALL) if guard == "all" else {guard}
    with hooks.leaving_out(skip):
        return torchtp.DistributedModelWrapper(build_llama(), plan=HF_PLAN)


def _models(world: int) -> dict[str, torch.nn.Module]:
    import torchtp
    from torchtp import hooks

    models: dict[str, torch.nn.Module] = {
        "floor": floor_model(dist.get_rank(), world),
        "torchtp": torchtp.DistributedModelWrapper(build_llama(), plan=HF_PLAN),
    }
    for guard in hooks.PER_CALL:
        models[f"torchtp without {guard}"] = _without(guard)
    models["torchtp without any per-call guard"] = _without("all")
    models["dtensor"] = dtensor_model(world)
    return {n: m.eval() for n, m in models.items()}


def _rank(rank: int, world: int, rounds: int, batch: int, tokens: int) -> dict[str, list[float]]:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    models = _models(world)
    ids = torch.randint(0, SMALL["vocab_size"], (batch, tokens),
                        generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {n: [] for n in models}
    names = list(models)
    with torch.no_grad():
        for m in models.values():  # warm-up
            for _ in range(3):
                m(ids, use_cache=False)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                m = models[name]
                for _ in range(5):  # five calls per turn: less barrier noise per sample
                    dist.barrier()
                    start = time.perf_counter()
                    m(ids, use_cache=False)
                    times[name].append(time.perf_counter() - start)
    return times


def _table(per_rank: list[dict[str, list[float]]], load: tuple[float, float]) -> str:
    med = {n: statistics.median(max(ts) for ts in zip(*(r[n] for r in per_rank), strict=True))
           * 1e3 for n in per_rank[0]}
    full = med["torchtp"]
    lines = [f"load average before -> after: {load[0]:.1f} -> {load[1]:.1f}", "",
             "| variant | ms | x floor | x DTensor | guard's cost |", "|---|---:|---:|---:|---:|"]
    for name, ms in med.items():
        cost = ""
        if name.startswith("torchtp without"):
            cost = f"{(full - ms) * 1e3:+.0f} us ({100 * (full - ms) / full:+.1f}%)"
        lines.append(f"| {name} | {ms:.3f} | {ms / med['floor']:.3f} | {ms / med['dtensor']:.3f} "
                     f"| {cost} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    before = os.getloadavg()[0]
    per_rank = launch(_rank, args.tp, args.rounds, args.batch, args.tokens)
    print(_table(per_rank, (before, os.getloadavg()[0])))


if __name__ == "__main__":
    main()
