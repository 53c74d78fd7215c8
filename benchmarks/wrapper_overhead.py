"""world_size=1 overhead of whole wrapped models (benchmarks/overhead.py times single layers).

Single process, no process group: every torchtp layer takes its
``world_size == 1`` path, which should cost nothing next to ``nn.Linear``.
Interleaved repetitions, medians, ratios (target <= 1.02).

    .venv/bin/python benchmarks/wrapper_overhead.py --json wo.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torchtp
from _llama import HF_PLAN, SMALL, build_llama


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))


def _cases() -> dict[str, tuple[nn.Module, nn.Module, torch.Tensor, Any]]:
    """name -> (plain model, wrapped copy, input, loss function)."""
    mlp = _mlp()
    llama = build_llama()
    ids = torch.randint(0, SMALL["vocab_size"], (1, 128), generator=torch.Generator().manual_seed(1))
    return {
        "mlp 512-2048-512, x=(16,512)": (mlp, torchtp.DistributedModelWrapper(copy.deepcopy(mlp)),
                                         torch.randn(16, 512), lambda out: out.sum()),
        "llama hidden=512 x4, 128 tokens": (
            llama, torchtp.DistributedModelWrapper(copy.deepcopy(llama), plan=HF_PLAN), ids,
            lambda out: out.logits.sum()),
    }


def _time(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(reps: int) -> list[dict[str, Any]]:
    """Median ms per (case, mode, variant) from interleaved repetitions."""
    rows = []
    for name, (plain, wrapped, x, loss) in _cases().items():
        for mode in ("forward", "forward+backward"):
            def run(model: nn.Module, mode: str = mode, x: Any = x, loss: Any = loss) -> None:
                if mode == "forward":
                    with torch.no_grad():
                        model(x)
                else:
                    loss(model(x)).backward()

            times: dict[str, list[float]] = {"plain": [], "torchtp": []}
            for model in (plain, wrapped):
                run(model)  # warm-up
            for _ in range(reps):
                times["plain"].append(_time(partial(run, plain)))
                times["torchtp"].append(_time(partial(run, wrapped)))
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            rows.append({"case": name, "mode": mode, "plain_ms": med["plain"],
                         "torchtp_ms": med["torchtp"], "ratio": med["torchtp"] / med["plain"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = measure(args.reps)
    print("| case | mode | plain ms | torchtp ms | ratio |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['mode']} | {r['plain_ms']:.3f} | {r['torchtp_ms']:.3f} | "
              f"{r['ratio']:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
