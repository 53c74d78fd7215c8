"""Calibrate and validate the cost model's ``cpu-gloo`` preset on this machine.

One run measures, with one thread per rank:

* single-thread GEMM FLOP/s and decode GEMV bytes/s (tp=1),
* Gloo all-reduce time for several sizes at tp 2 and 4 (fits alpha and bandwidth),
* torchtp forward latency of the small Llama (benchmarks/_llama.py) at tp 1, 2, 4:
  prefill (1 x 128 tokens) and decode (one token, 128 cached).

It fits a preset from the microbenchmarks and the tp=1 run only (the per-layer
overhead comes from tp=1 decode), then predicts tp=2 and tp=4 with the fitted
preset and with the stored ``cpu-gloo`` preset, and prints predicted vs
measured. The tp=2/4 forwards are never used for fitting.

    PYTHONPATH=.shim .venv/bin/python benchmarks/costmodel_validate.py --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torchtp
from _llama import HF_PLAN, SMALL, build_llama
from torchtp.cli._launch import launch
from torchtp.costmodel import ModelDims, allreduce_time, estimate, get_hardware, ring_steps

SIZES = [1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22]  # all-reduce payload bytes
SEQ = 128


def _median_time(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    if dist.is_initialized():  # the slowest rank's median
        t = torch.tensor([statistics.median(times)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()
    return statistics.median(times)


def _forward_times(reps: int) -> dict[str, float]:
    model = torchtp.DistributedModelWrapper(build_llama(), plan=HF_PLAN)
    ids = torch.randint(0, SMALL["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        prefill = _median_time(lambda: model(ids, use_cache=False), reps)
        out = model(ids, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)  # (1, 1)
        cache = out.past_key_values

        def step() -> None:
            model(token, past_key_values=cache, use_cache=True)
            cache.crop(-1)  # drop the new token: the context stays at SEQ tokens

        step()
        decode = _median_time(step, reps * 4)
    return {"prefill": prefill, "decode": decode}


def _rank(rank: int, world: int, reps: int) -> dict[str, Any]:
    result: dict[str, Any] = {"forward": _forward_times(reps)}
    if world == 1:
        a, w = torch.randn(SEQ, SMALL["hidden_size"]), torch.randn(SMALL["intermediate_size"],
                                                                   SMALL["hidden_size"])
        gemm = _median_time(lambda: a @ w.T, reps * 4)
        gemv = _median_time(lambda: a[:1] @ w.T, reps * 20)
        result["gemm_flops"] = 2 * a.numel() * w.shape[0] / gemm
        result["gemv_bytes_per_s"] = w.numel() * 4 / gemv
    else:
        # Every rank multiplies its own shard at once: how much compute do N ranks get?
        a, w = torch.randn(SEQ, SMALL["hidden_size"]), torch.randn(SMALL["intermediate_size"],
                                                                   SMALL["hidden_size"])
        gemm = _median_time(lambda: a @ w.T, reps * 4)
        result["gemm_flops"] = 2 * a.numel() * w.shape[0] / gemm
        result["allreduce"] = {n: _median_time(lambda n=n: dist.all_reduce(torch.ones(n // 4)), reps * 4)
                               for n in SIZES}
    return result


def fit(measured: dict[int, dict[str, Any]], dims: ModelDims) -> Any:
    """A cpu-gloo preset fitted from microbenchmarks and the tp=1 forward."""
    # alpha from tp=2's small messages (latency-bound), bandwidth from its large ones.
    sizes = measured[2]["allreduce"]
    alpha = statistics.median(sizes[n] for n in SIZES[:2]) / ring_steps(2)
    inv_bw = statistics.median((sizes[n] - alpha * ring_steps(2)) / n for n in SIZES[-2:])
    over = statistics.median((t - 1.5 * n * inv_bw) / ring_steps(4)
                             for n, t in measured[4]["allreduce"].items())
    # effective cores: N ranks' concurrent GEMM rate relative to one process alone
    cores = statistics.mean(tp * measured[tp]["gemm_flops"] / measured[1]["gemm_flops"] for tp in (2, 4))
    base = dataclasses.replace(
        get_hardware("cpu-gloo"), peak_flops=measured[1]["gemm_flops"],
        mem_bandwidth=measured[1]["gemv_bytes_per_s"], latency=float(alpha),
        bus_bandwidth=float(1 / inv_bw), layer_overhead=0.0, effective_cores=round(cores, 2),
        oversubscribed_latency=float(over))
    no_overhead = estimate(dims, base, 1, seq=SEQ, phase="decode").total
    overhead = (measured[1]["forward"]["decode"] - no_overhead) / dims.layers
    return dataclasses.replace(base, layer_overhead=max(overhead, 0.0))


def compare(measured: dict[int, dict[str, Any]], dims: ModelDims, hw: Any) -> list[dict[str, Any]]:
    """Predicted vs measured forward time per tp and phase."""
    rows = []
    for tp, res in measured.items():
        for phase in ("prefill", "decode"):
            pred = estimate(dims, hw, tp, seq=SEQ, phase=phase).total
            meas = res["forward"][phase]
            rows.append({"tp": tp, "phase": phase, "predicted_ms": pred * 1e3,
                         "measured_ms": meas * 1e3, "error": pred / meas - 1})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    dims = ModelDims.make(hidden=SMALL["hidden_size"], layers=SMALL["num_hidden_layers"],
                          heads=SMALL["num_attention_heads"], ffn=SMALL["intermediate_size"],
                          vocab=SMALL["vocab_size"])
    measured = {}
    for tp in (1, 2, 4):
        print(f"measuring tp={tp} ...", file=sys.stderr, flush=True)
        measured[tp] = launch(_rank, tp, args.reps, timeout=900)[0]
    fitted = fit(measured, dims)
    print(f"fitted cpu-gloo: peak_flops={fitted.peak_flops:.3g} FLOP/s, mem_bandwidth="
          f"{fitted.mem_bandwidth:.3g} B/s, latency={fitted.latency * 1e3:.3f} ms/step, "
          f"bus_bandwidth={fitted.bus_bandwidth / 1e9:.2f} GB/s, "
          f"layer_overhead={fitted.layer_overhead * 1e3:.3f} ms, effective_cores="
          f"{fitted.effective_cores}, oversubscribed_latency={fitted.oversubscribed_latency * 1e3:.3f} ms")
    for tp in (2, 4):
        for n, t in measured[tp]["allreduce"].items():
            print(f"all-reduce tp={tp} {n:>8} B: measured {t * 1e3:7.3f} ms, "
                  f"fitted {allreduce_time(n, tp, fitted) * 1e3:7.3f} ms")
    report = {"measured": measured, "fitted": fitted.as_dict()}
    for label, hw in (("fitted now", fitted), ("stored preset", get_hardware("cpu-gloo"))):
        rows = compare(measured, dims, hw)
        report[label] = rows
        print(f"\n{label}: predicted vs measured forward latency (tp=1 was used for fitting)")
        print("| tp | phase | predicted ms | measured ms | error |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['tp']} | {r['phase']} | {r['predicted_ms']:.2f} | {r['measured_ms']:.2f} | "
                  f"{r['error']:+.0%} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
