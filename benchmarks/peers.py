"""torchtp vs PyTorch DTensor TP vs transformers tp_plan="auto" vs a hand-written floor.

One run, tp=2 then tp=4, Gloo CPU processes (one thread each), the small
Llama of benchmarks/_llama.py with the same random weights everywhere:

* forward latency, prefill (1 x 128 tokens) and decode (1 token, 128 cached),
* a training step (forward + backward + SGD) of torchtp vs DTensor TP,

each variant timed in interleaved repetitions (barrier before every call,
slowest rank per repetition, median over repetitions). Prints a table of
milliseconds and ratios to the floor and writes JSON.

    .venv/bin/python benchmarks/peers.py --json peers.json

``--device cuda`` runs the same on CUDA tensors, with a CUDA synchronize around
every timed call. The ranks then use ``"cpu:gloo,cuda:gloo"``: NCCL refuses two
ranks on one GPU, so on a one-GPU machine every variant's all-reduce goes
through Gloo's host copies alike (ratios between variants are what it shows).
``--dtype bfloat16`` casts every variant's weights.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _llama import SMALL, build_llama
from _variants import build_all, dtensor_model, torchtp_model
from torchtp.cli._launch import launch

SEQ = 128


def _sync() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _timed(fn: Any) -> float:
    _sync()
    dist.barrier()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def _decode_step(model: Any, ids: torch.Tensor) -> Any:
    out = model(ids, use_cache=True)
    token, cache = out.logits[:, -1:].argmax(-1), out.past_key_values  # token: (1, 1)

    def step() -> None:
        model(token, past_key_values=cache, use_cache=True)
        cache.crop(-1)  # keep the context at SEQ tokens

    return step


def _local(t: Any) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _forward(rank: int, world: int, reps: int, hf_path: str, device: str,
             dtype: torch.dtype) -> dict[str, Any]:
    models, failures = build_all(rank, world, hf_path, device, dtype)
    ids = torch.randint(0, SMALL["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    times: dict[str, dict[str, list[float]]] = {n: {"prefill": [], "decode": []} for n in models}
    with torch.inference_mode():
        want = build_llama().to(device=device, dtype=dtype)(ids).logits.float()
        errors = {n: (_local(m(ids).logits).float() - want).abs().max().item()
                  for n, m in models.items()}
        steps = {n: _decode_step(m, ids) for n, m in models.items()}
        for name, m in models.items():  # warm-up
            m(ids, use_cache=False)
            steps[name]()
        names = list(models)
        for rep in range(reps):
            # rotate the order so no variant always runs first after the barrier
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                m = models[name]
                times[name]["prefill"].append(_timed(lambda m=m: m(ids, use_cache=False)))
                times[name]["decode"].append(_timed(steps[name]))
    return {"times": times, "failures": failures, "max_abs_error_vs_unsharded": errors}


def _train(rank: int, world: int, reps: int, device: str, dtype: torch.dtype) -> dict[str, list[float]]:
    ids = torch.randint(0, SMALL["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(2))
    ids = ids.to(device)
    models = {"torchtp": torchtp_model(device, dtype).train(),
              "dtensor": dtensor_model(world, device, dtype).train()}
    # foreach=False: DTensor refuses a foreach op over its mix of DTensor and plain
    # parameters (the default on CUDA); both variants take the same per-tensor path.
    opts = {n: torch.optim.SGD(m.parameters(), lr=1e-3, foreach=False) for n, m in models.items()}

    def step(name: str) -> None:
        opts[name].zero_grad(set_to_none=True)
        models[name](ids, labels=ids).loss.backward()
        opts[name].step()

    times: dict[str, list[float]] = {n: [] for n in models}
    for name in models:
        step(name)  # warm-up
    names = list(models)
    for rep in range(reps):
        for name in names[rep % 2:] + names[:rep % 2]:
            times[name].append(_timed(lambda name=name: step(name)))
    return times


def _rank(rank: int, world: int, reps: int, hf_path: str, device: str = "cpu",
          dtype_name: str = "float32") -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    dtype = getattr(torch, dtype_name)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    result = _forward(rank, world, reps, hf_path, device, dtype)
    result["train"] = _train(rank, world, max(3, reps // 2), device, dtype)
    return result


def _median_of_slowest(per_rank: list[list[float]]) -> float:
    return statistics.median(max(ts) for ts in zip(*per_rank, strict=True))


def summarize(world: int, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians (ms) per variant and phase, and ratios to the floor."""
    first = per_rank[0]
    rows: dict[str, Any] = {}
    for name in first["times"]:
        rows[name] = {ph: _median_of_slowest([r["times"][name][ph] for r in per_rank]) * 1e3
                      for ph in ("prefill", "decode")}
        rows[name]["max_abs_error"] = max(r["max_abs_error_vs_unsharded"][name] for r in per_rank)
    for name in first["train"]:
        rows.setdefault(name, {})["train_step"] = _median_of_slowest(
            [r["train"][name] for r in per_rank]) * 1e3
    floor = rows.get("floor", {})
    for row in rows.values():
        for ph in ("prefill", "decode"):
            if ph in row and ph in floor:
                row[f"{ph}_vs_floor"] = row[ph] / floor[ph]
    if "train_step" in rows.get("dtensor", {}):
        rows["torchtp"]["train_vs_dtensor"] = rows["torchtp"]["train_step"] / rows["dtensor"]["train_step"]
    return {"tp": world, "variants": rows, "failures": first["failures"]}


def render(results: list[dict[str, Any]]) -> str:
    """Markdown table of all results."""
    lines = ["| tp | variant | prefill ms | x floor | decode ms | x floor | train step ms | max abs err |",
             "|---|---|---|---|---|---|---|---|"]
    for res in results:
        for name, r in res["variants"].items():
            cells = [f"{r[k]:.2f}" if k in r else "-" for k in ("prefill", "prefill_vs_floor", "decode",
                                                                 "decode_vs_floor", "train_step")]
            err = f"{r['max_abs_error']:.1e}" if "max_abs_error" in r else "-"
            lines.append(f"| {res['tp']} | {name} | " + " | ".join(cells) + f" | {err} |")
        for name, why in res["failures"].items():
            lines.append(f"| {res['tp']} | {name} | failed: {why[:120]} | | | | | |")
    for res in results:
        t = res["variants"].get("torchtp", {})
        if "train_vs_dtensor" in t:
            ratio = t["train_vs_dtensor"]
            lines.append(f"\ntp={res['tp']}: torchtp training step = {ratio:.2f} x DTensor TP")
    return "\n".join(lines)


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=30, help="interleaved repetitions per variant")
    parser.add_argument("--tp", default="2,4", help="tp sizes (default 2,4)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    backend = "gloo" if args.device == "cpu" else "cpu:gloo,cuda:gloo"
    results = []
    with tempfile.TemporaryDirectory(prefix="torchtp-peers-") as tmp:
        build_llama().save_pretrained(tmp)  # for transformers' from_pretrained(tp_plan="auto")
        for tp in (int(x) for x in args.tp.split(",")):
            print(f"tp={tp}: {args.reps} interleaved repetitions ...", file=sys.stderr, flush=True)
            results.append(summarize(tp, launch(_rank, tp, args.reps, tmp, args.device, args.dtype,
                                                backend=backend, timeout=1800)))
    print(render(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": SMALL, "seq": SEQ, "reps": args.reps,
                                               "device": _device_name(args.device),
                                               "dtype": args.dtype, "torch": torch.__version__,
                                               "loadavg_after": os.getloadavg(), "results": results},
                                              indent=2))


if __name__ == "__main__":
    main()
