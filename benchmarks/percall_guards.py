"""Per-call cost of torchtp's default-on guards: a small-batch forward against the floor and DTensor.

Issue 21's measure: a small-batch forward (``--batch`` x ``--tokens``, no KV
cache, ``torch.no_grad``) of benchmarks/_llama.py's small Llama at tp 2 on
Gloo (one thread per rank), in one run, interleaved: the hand-written
plain-tensor floor (sliced weights, one ``dist.all_reduce`` per weight-column
split), torchtp with every default guard, and PyTorch DTensor TP with the
same plan. Every round times each variant (order rotated, a barrier before
every call, the slowest rank's time); the table gives medians over calls
and their ratios to the floor and to DTensor, and the paired ratios: the
median over rounds of each round's ratio, which cancels the load drifting
between rounds.

End-to-end differences of a few percent drown in this machine's noise, so
each per-call guard's own work is timed alone, in the same processes, on the
same inputs (median of many calls): the forward door's three hooks
(:mod:`torchtp.guards.forward_door`), and the dispatch of three hooks
themselves (a forward of an identity module with and without them). Their sum
is what the guards add to every forward.

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
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _llama import HF_PLAN, SMALL, build_llama
from _variants import dtensor_model, floor_model
from torchtp.cli._launch import launch

CALLS = 5  # calls per variant per round


def _models(world: int) -> dict[str, torch.nn.Module]:
    import torchtp

    models: dict[str, torch.nn.Module] = {
        "floor": floor_model(dist.get_rank(), world),
        "torchtp": torchtp.DistributedModelWrapper(build_llama(), plan=HF_PLAN),
        "dtensor": dtensor_model(world),
    }
    return {n: m.eval() for n, m in models.items()}


def _alone(fn: Any, n: int = 2000) -> float:
    """Median microseconds of ``fn()`` over ``n`` calls (in blocks of 20)."""
    samples = []
    for _ in range(n // 20):
        start = time.perf_counter()
        for _ in range(20):
            fn()
        samples.append((time.perf_counter() - start) / 20)
    return statistics.median(samples) * 1e6


def _guards_alone(wrapped: torch.nn.Module, ids: torch.Tensor, group: Any) -> dict[str, float]:
    """The forward door's own work per forward, microseconds, timed alone: its three
    hooks called as torch calls them (the input check's hash riding a collective that
    carried it, as the model's first all-reduce does), and the hooks' dispatch."""
    from torchtp.comm import ops as _comm
    from torchtp.guards.forward_door import ForwardDoor
    from torchtp.plans import ShardContext

    model = wrapped.base_model
    kwargs = {"input_ids": ids, "use_cache": False}
    ctx = ShardContext(dist.get_world_size(group), dist.get_rank(group), group)
    door = ForwardDoor(model, ctx, [])

    def forward_door() -> None:
        door.before(model, (), kwargs)  # hash + join the next collective
        ride = door.inputs.pending.ride  # type: ignore[union-attr]
        ride.sums = torch.zeros(64)  # as if the model's all-reduce carried it
        door.returned(model, (), kwargs, None)  # the verdict
        door.always(model, (), kwargs, None)
        _comm.cancel_ride(group, ride)

    probe = torch.nn.Identity()
    bare = _alone(lambda: probe(ids))
    probe.register_forward_pre_hook(lambda m, a, k: None, with_kwargs=True)
    probe.register_forward_hook(lambda m, a, k, o: None, with_kwargs=True)
    probe.register_forward_hook(lambda m, a, k, o: None, with_kwargs=True, always_call=True)
    return {
        "forward door (its three hooks' work)": _alone(forward_door),
        "three hooks' dispatch": _alone(lambda: probe(ids)) - bare,
    }


def _rank(rank: int, world: int, rounds: int, batch: int,
          tokens: int) -> tuple[dict[str, list[float]], dict[str, float]]:
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
                for _ in range(CALLS):  # several calls per turn: less barrier noise per sample
                    dist.barrier()
                    start = time.perf_counter()
                    m(ids, use_cache=False)
                    times[name].append(time.perf_counter() - start)
        alone = _guards_alone(models["torchtp"], ids, models["torchtp"].group)
    return times, alone


def _table(per_rank: list[tuple[dict[str, list[float]], dict[str, float]]],
           load: tuple[float, float]) -> str:
    times = [t for t, _ in per_rank]
    slowest = {n: [max(ts) for ts in zip(*(r[n] for r in times), strict=True)] for n in times[0]}
    med = {n: statistics.median(ts) * 1e3 for n, ts in slowest.items()}
    # Paired: each round's mean per variant (its CALLS calls, taken back to back with the
    # other variants'), divided by the same round's mean of the reference; median over rounds.
    rounds = {n: [statistics.fmean(ts[i:i + CALLS]) for i in range(0, len(ts), CALLS)]
              for n, ts in slowest.items()}

    def paired(name: str, ref: str) -> float:
        return statistics.median(a / b for a, b in zip(rounds[name], rounds[ref], strict=True))

    lines = [f"load average before -> after: {load[0]:.1f} -> {load[1]:.1f}", "",
             "| variant | ms | x floor | x DTensor | x floor, paired | x DTensor, paired |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, ms in med.items():
        lines.append(f"| {name} | {ms:.3f} | {ms / med['floor']:.3f} | {ms / med['dtensor']:.3f} "
                     f"| {paired(name, 'floor'):.3f} | {paired(name, 'dtensor'):.3f} |")
    alone = per_rank[0][1]
    lines += ["", "| per-call guard (rank 0, timed alone) | us per forward | % of torchtp's |",
              "|---|---:|---:|"]
    for name, us in [*alone.items(), ("all of them", sum(alone.values()))]:
        lines.append(f"| {name} | {us:.1f} | {100 * us / (med['torchtp'] * 1e3):.2f}% |")
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
