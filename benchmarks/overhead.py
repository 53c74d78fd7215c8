"""world_size=1 overhead of torchtp's parallel Linear layers versus nn.Linear.

At world size 1 both layers must be nn.Linear (same math, no collectives), so
the only cost is Python dispatch. This measures it as ratios taken in ONE run:
for each shape, nn.Linear, RowParallelLinear and ColumnParallelLinear (same
weights) are timed in interleaved rounds, so machine load hits all three alike,
and the reported ratio is median(layer) / median(nn.Linear).

Usage:
    python benchmarks/overhead.py            # table (about 30-60 s on 2 cores)
    python benchmarks/overhead.py --json     # also write JSON to stdout after the table
    python benchmarks/overhead.py --quick    # fewer rounds, for a smoke test
    python benchmarks/overhead.py --threads 4  # intra-op threads (default 1)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

import torchtp
from torchtp import ColumnParallelLinear, RowParallelLinear

# (name, tokens, in_features, out_features): a decode-sized call where dispatch
# dominates, a small and a mid-size batch, and a large one where compute dominates.
SHAPES: list[tuple[str, int, int, int]] = [
    ("tiny", 1, 64, 64),
    ("small", 32, 256, 256),
    ("medium", 256, 1024, 1024),
    ("large", 256, 2048, 2048),
]
LAYERS = ("nn.Linear", "RowParallelLinear", "ColumnParallelLinear")


@dataclass
class Result:
    """Medians (microseconds) and ratios of medians to nn.Linear for one shape and mode."""

    shape: str
    tokens: int
    in_features: int
    out_features: int
    mode: str
    median_us: dict[str, float]
    ratio: dict[str, float]


def build(in_f: int, out_f: int) -> dict[str, nn.Module]:
    """The three layers with identical weights (same seed, world_size=1)."""
    torch.manual_seed(0)
    ref = nn.Linear(in_f, out_f)
    row = RowParallelLinear.from_linear(ref, world_size=1, rank=0)
    col = ColumnParallelLinear.from_linear(ref, world_size=1, rank=0)
    return {"nn.Linear": ref, "RowParallelLinear": row, "ColumnParallelLinear": col}


def step_fn(layer: nn.Module, x: torch.Tensor, mode: str) -> Callable[[], None]:
    """One timed call: forward only (no autograd graph) or forward + backward."""
    if mode == "forward":
        def fwd() -> None:
            with torch.no_grad():
                layer(x)
        return fwd

    def fwd_bwd() -> None:
        layer(x).sum().backward()
    return fwd_bwd


def time_calls(fn: Callable[[], None], calls: int) -> float:
    """Microseconds per call, averaged over ``calls`` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def calls_per_sample(fn: Callable[[], None], target_s: float) -> int:
    """How many calls make one sample last about ``target_s`` seconds."""
    fn()
    once = max(time_calls(fn, 3) / 1e6, 1e-7)
    return max(1, min(2000, int(target_s / once)))


def measure(name: str, tokens: int, in_f: int, out_f: int, mode: str,
            rounds: int, target_s: float) -> Result:
    layers = build(in_f, out_f)
    x = torch.randn(tokens, in_f, requires_grad=(mode == "forward+backward"))  # (T, in)
    fns = {k: step_fn(m, x, mode) for k, m in layers.items()}
    calls = calls_per_sample(fns["nn.Linear"], target_s)
    samples: dict[str, list[float]] = {k: [] for k in LAYERS}
    for r in range(rounds):
        # Rotate the order each round so no layer always runs first (cache, turbo).
        order = LAYERS[r % 3:] + LAYERS[:r % 3]
        for key in order:
            samples[key].append(time_calls(fns[key], calls))
    med = {k: statistics.median(v) for k, v in samples.items()}
    ratio = {k: med[k] / med["nn.Linear"] for k in LAYERS}
    return Result(name, tokens, in_f, out_f, mode, med, ratio)


def print_table(results: list[Result]) -> None:
    print(f"torchtp {torchtp.__version__}, torch {torch.__version__}, "
          f"{platform.machine()}, threads={torch.get_num_threads()}, world_size=1")
    print("ratio = median(layer time) / median(nn.Linear time), all measured in this run; "
          "us = microseconds per call\n")
    head = (f"{'shape':<7} {'T x in -> out':>20} {'mode':<17} {'nn.Linear us':>12} "
            f"{'Row us':>9} {'Row ratio':>9} {'Col us':>9} {'Col ratio':>9}")
    print(head)
    print("-" * len(head))
    for r in results:
        dims = f"{r.tokens} x {r.in_features} -> {r.out_features}"
        m, q = r.median_us, r.ratio
        row, col = "RowParallelLinear", "ColumnParallelLinear"
        print(f"{r.shape:<7} {dims:>20} {r.mode:<17} {m['nn.Linear']:>12.1f} "
              f"{m[row]:>9.1f} {q[row]:>8.3f}x {m[col]:>9.1f} {q[col]:>8.3f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="also print results as JSON")
    parser.add_argument("--quick", action="store_true", help="few rounds (smoke test)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per shape")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: steadier on a shared machine)")
    args = parser.parse_args()
    if os.environ.get("WORLD_SIZE", "1") != "1":
        parser.error("run this benchmark in one process (world_size=1), not under torchrun")
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (5 if args.quick else 25)
    target_s = 0.005 if args.quick else 0.02
    torchtp.init_tensor_parallel()  # world size 1: no process group
    results = [measure(name, t, i, o, mode, rounds, target_s)
               for name, t, i, o in SHAPES for mode in ("forward", "forward+backward")]
    print_table(results)
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
