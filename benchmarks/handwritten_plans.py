"""A hand-written Llama (torchtitan's shape) at tp 2: automatic vs hand-written vs gather-everything.

Three wrappings of the same model, timed interleaved in the same processes:

* ``auto``: ``DistributedModelWrapper(model)`` with no plan (dataflow pairs, whole heads);
* ``hand-written``: the Megatron plan a user would write (``TITAN_PLAN``);
* ``gather-everything``: every Linear split on out_features and all-gathered
  (what the automatic plan did for hand-written models before dataflow pairing).

Forward (``torch.no_grad``) and training step (forward, backward, SGD), median
milliseconds over interleaved repetitions on the slowest rank, ratios to the
hand-written plan from the same run.

    .venv/bin/python benchmarks/handwritten_plans.py [--tp 2] [--dim 512] [--reps 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))
from _handwritten import TITAN_PLAN, VOCAB, TitanLlama

import torchtp
from torchtp.cli._launch import launch

GATHER_ALL = {"layers.*.attention.w?": "colwise_gather_output",
              "layers.*.feed_forward.w?": "colwise_gather_output",
              "output": "colwise_gather_output"}
PLANS: dict[str, Any] = {"auto": None, "hand-written": TITAN_PLAN, "gather-everything": GATHER_ALL}


def _rank(rank: int, world: int, dim: int, layers: int, tokens: int, reps: int) -> dict[str, Any]:
    models, optims, counts = {}, {}, {}
    for name, plan in PLANS.items():
        torch.manual_seed(0)
        model = TitanLlama(dim=dim, n_layers=layers, n_heads=8, n_kv_heads=4,
                           hidden_dim=dim * 11 // 4, max_seq_len=tokens)
        models[name] = torchtp.DistributedModelWrapper(model, plan=plan)
        optims[name] = torch.optim.SGD(models[name].parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (2, tokens + 1), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def forward(name: str) -> None:
        with torch.no_grad():
            models[name](x)

    def train_step(name: str) -> None:
        optims[name].zero_grad()
        F.cross_entropy(models[name](x).flatten(0, 1), y.flatten()).backward()
        optims[name].step()

    for name in PLANS:
        with torchtp.count_collectives() as fwd:
            forward(name)
        counts[name] = dict(fwd.counts)
        train_step(name)  # warm-up
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(reps):
        for mode, fn in (("forward", forward), ("train step", train_step)):
            for name in PLANS:
                dist.barrier()
                start = time.perf_counter()
                fn(name)
                times.setdefault((mode, name), []).append((time.perf_counter() - start) * 1e3)
    return {"counts": counts, "ms": {f"{m}|{n}": statistics.median(v)
                                     for (m, n), v in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128, help="sequence length (batch 2)")
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    results = launch(_rank, args.tp, args.dim, args.layers, args.tokens, args.reps)
    print(f"torchtitan-shaped Llama, dim {args.dim}, {args.layers} layers, 8 heads / 4 KV heads, "
          f"batch 2 x {args.tokens} tokens, tp={args.tp}: median ms (slowest rank)")
    print("| plan | collectives per forward | forward ms | vs hand | train step ms | vs hand |")
    print("|---|---|---|---|---|---|")
    slowest = {k: max(r["ms"][k] for r in results) for k in results[0]["ms"]}
    for name in PLANS:
        ops = ", ".join(f"{n} {op}" for op, n in sorted(results[0]["counts"][name].items()))
        fwd, step = slowest[f"forward|{name}"], slowest[f"train step|{name}"]
        print(f"| {name} | {ops} | {fwd:.2f} | {fwd / slowest['forward|hand-written']:.2f}x | "
              f"{step:.2f} | {step / slowest['train step|hand-written']:.2f}x |")


if __name__ == "__main__":
    main()
