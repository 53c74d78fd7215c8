"""Per-call cost of torchtp's layers versus the hand-written floor, decode-sized.

End-to-end latencies on a shared 2-core machine swing by +-10% between runs,
more than the 5% target against the floor. This isolates what torchtp itself
adds: one decode-sized call (1 token) of each layer, interleaved with the
floor's equivalent in the same processes, 20 repetitions of 200 calls,
medians in microseconds.

* column layer (weight columns split + one all-reduce) vs ``F.linear`` + ``dist.all_reduce``;
* row layer (weight rows split, no communication) vs ``F.linear`` on the sliced weight.

    .venv/bin/python benchmarks/percall.py [--tp 2] [--hidden 512] [--ffn 1408]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import torchtp
from torchtp.cli._launch import launch


def _rank(rank: int, world: int, hidden: int, ffn: int) -> dict[str, float]:
    torch.manual_seed(0)
    down, up = nn.Linear(ffn, hidden, bias=False), nn.Linear(hidden, ffn, bias=False)
    col = torchtp.ColumnParallelLinear.from_linear(down)  # in_features split, all-reduce
    row = torchtp.RowParallelLinear.from_linear(up)  # out_features split
    n = ffn // world
    w_col = down.weight.detach()[:, rank * n:(rank + 1) * n].contiguous()  # (hidden, ffn/tp)
    w_row = row.weight.detach().clone()  # (ffn/tp, hidden)
    x_col, x_row = torch.randn(1, 1, n), torch.randn(1, 1, hidden)  # one decode token

    def floor_col() -> torch.Tensor:
        y = F.linear(x_col, w_col)
        dist.all_reduce(y)
        return y

    calls = {"floor column": floor_col, "torchtp column": lambda: col(x_col),
             "floor row": lambda: F.linear(x_row, w_row), "torchtp row": lambda: row(x_row)}
    times: dict[str, list[float]] = {k: [] for k in calls}
    with torch.inference_mode():
        for f in calls.values():  # warm-up
            for _ in range(50):
                f()
        for _ in range(20):
            for name, f in calls.items():
                dist.barrier()
                start = time.perf_counter()
                for _ in range(200):
                    f()
                times[name].append((time.perf_counter() - start) / 200 * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1408)
    args = parser.parse_args()
    results = launch(_rank, args.tp, args.hidden, args.ffn)
    print(f"tp={args.tp}, one decode token, hidden {args.hidden}, ffn {args.ffn}: "
          "median microseconds per call (slowest rank)")
    print(f"{'layer':<8} {'floor':>9} {'torchtp':>9} {'added':>8}")
    for layer in ("column", "row"):
        floor = max(r[f"floor {layer}"] for r in results)
        ours = max(r[f"torchtp {layer}"] for r in results)
        print(f"{layer:<8} {floor:>9.1f} {ours:>9.1f} {ours - floor:>+8.1f}")


if __name__ == "__main__":
    main()
