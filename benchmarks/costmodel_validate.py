"""Calibrate and validate the cost model's ``cpu-gloo`` preset on this machine.

One run measures, with one thread per rank, in interleaved rounds:

* single-thread GEMM FLOP/s and decode GEMV bytes/s (tp=1),
* Gloo all-reduce time for several sizes at tp 2 and 4 (fits alpha and bandwidth),
  timed as the forward issues them: bursts of GEMV + all-reduce, minus the GEMVs,
* torchtp forward latency of the small Llama (benchmarks/_llama.py) at tp 1, 2, 4:
  prefill (1 x 128 tokens) and decode (one token, 128 cached).

It fits a preset from the microbenchmarks and the tp=1 run only (the per-layer
overhead comes from tp=1 decode), then predicts tp=2 and tp=4 with the fitted
preset and with the stored ``cpu-gloo`` preset, and prints predicted vs
measured. The tp=2/4 forwards are never used for fitting.

    .venv/bin/python benchmarks/costmodel_validate.py --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
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
BURST = 8  # all-reduces per timed burst (a 4-layer forward issues 8)
# GEMMs per timed loop: tens of ms, as long as a prefill, so the loop gets the same
# share of a busy machine's cores as the forward does (short calls dodge preemption).
GEMM_LOOP = 60


def _timed(fn: Any) -> float:
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _slowest_median(times: list[float]) -> float:
    """Median over rounds; across ranks the slowest rank's median."""
    t = torch.tensor([statistics.median(times)])
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _rank(rank: int, world: int, rounds: int) -> dict[str, Any]:
    """Forward latencies and microbenchmarks, interleaved in rounds.

    Interleaving puts every measurement under the same background load (the
    machine is shared), so the microbenchmarks describe the conditions the
    forwards ran in.
    """
    model = torchtp.DistributedModelWrapper(build_llama(), plan=HF_PLAN)
    ids = torch.randint(0, SMALL["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
    # the GEMM each rank runs in its MLP: (SEQ, hidden) @ (ffn/tp, hidden)^T
    a = torch.randn(SEQ, SMALL["hidden_size"])
    w = torch.randn(SMALL["intermediate_size"] // world, SMALL["hidden_size"])
    times: dict[str, list[float]] = {}

    def record(key: str, fn: Any, reps: int = 1) -> None:
        times.setdefault(key, []).append(statistics.median(_timed(fn) for _ in range(reps)))

    with torch.inference_mode():
        out = model(ids, use_cache=True)
        token, cache = out.logits[:, -1:].argmax(-1), out.past_key_values  # token: (1, 1)

        def decode() -> None:
            model(token, past_key_values=cache, use_cache=True)
            cache.crop(-1)  # drop the new token: the context stays at SEQ tokens

        decode()
        for _ in range(rounds):
            record("prefill", lambda: model(ids, use_cache=False))
            record("decode", decode, 3)
            record("gemm", lambda: [a @ w.T for _ in range(GEMM_LOOP)])
            record("gemv", lambda: a[:1] @ w.T, 20)
            if world > 1:
                record("compute_burst", lambda: _burst(a, w, None))
                for n in SIZES:
                    record(n, lambda n=n: _burst(a, w, torch.ones(n // 4)))
    med = {k: _slowest_median(v) for k, v in times.items()}
    result: dict[str, Any] = {"forward": {"prefill": med["prefill"], "decode": med["decode"]},
                              "gemm_flops": 2 * a.numel() * w.shape[0] * GEMM_LOOP / med["gemm"],
                              "gemv_bytes_per_s": w.numel() * 4 / med["gemv"]}
    if world > 1:
        # all-reduce time as the forward sees it: between computations, ranks not pre-aligned
        result["allreduce"] = {n: (med[n] - med["compute_burst"]) / BURST for n in SIZES}
    return result


def _burst(a: torch.Tensor, w: torch.Tensor, payload: torch.Tensor | None) -> None:
    """BURST x (ten decode-sized GEMVs, then an all-reduce of ``payload`` if given).

    The GEMVs stand for the ~0.5 ms of work between a decoder layer's two
    all-reduces: long enough for a rank to be preempted on a busy machine, so
    the all-reduce also pays the wait for the slowest rank, as in a forward.
    """
    for _ in range(BURST):
        for _ in range(10):
            a[:1] @ w.T  # (1, ffn/tp)
        if payload is not None:
            dist.all_reduce(payload)


def fit(measured: dict[int, dict[str, Any]], dims: ModelDims) -> Any:
    """A cpu-gloo preset fitted from microbenchmarks and the tp=1 forward."""
    # alpha from tp=2's small messages (latency-bound), bandwidth from its large ones.
    sizes = measured[2]["allreduce"]
    alpha = statistics.median(sizes[n] for n in SIZES[:2]) / ring_steps(2)
    inv_bw = statistics.median((sizes[n] - alpha * ring_steps(2)) / n for n in SIZES[-2:])
    over = statistics.median((t - 1.5 * n * inv_bw) / ring_steps(4)
                             for n, t in measured[4]["allreduce"].items())
    # effective cores: N ranks' concurrent GEMM rate relative to one process alone
    # (at least 1: one rank alone gets what the tp=1 calibration run got)
    cores = max(1.0, statistics.mean(min(tp, tp * measured[tp]["gemm_flops"] / measured[1]["gemm_flops"])
                                     for tp in (2, 4)))
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
    parser.add_argument("--rounds", type=int, default=9, help="interleaved measurement rounds")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    dims = ModelDims.make(hidden=SMALL["hidden_size"], layers=SMALL["num_hidden_layers"],
                          heads=SMALL["num_attention_heads"], ffn=SMALL["intermediate_size"],
                          vocab=SMALL["vocab_size"])
    measured = {}
    for tp in (1, 2, 4):
        print(f"measuring tp={tp} ...", file=sys.stderr, flush=True)
        measured[tp] = launch(_rank, tp, args.rounds, timeout=900)[0]
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
    report = {"measured": measured, "fitted": fitted.as_dict(), "loadavg": os.getloadavg()}
    print(f"load average during the run (1/5/15 min): {os.getloadavg()}")
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
