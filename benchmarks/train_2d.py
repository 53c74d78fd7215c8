"""A dp 2 x tp 2 training step: torchtp + FSDP2 vs PyTorch DTensor TP + FSDP2.

One run, 4 Gloo CPU processes (one thread each), the small Llama of
benchmarks/_llama.py with the same random weights everywhere, on the mesh of
``init_tensor_parallel(tp_size=2)``. A step is forward + backward + gradient
clipping (``torchtp.clip_grad_norm_`` / ``torch.nn.utils.clip_grad_norm_`` on
DTensors, one norm per mesh) + AdamW (``foreach=False`` for both). Both
variants live in the same processes and are timed in interleaved repetitions
(barrier before every step, slowest rank per repetition, median). Peak RSS
is measured in two further runs, one variant
each (a process's peak cannot be split between two variants). Prints a table
of milliseconds, MiB and the torchtp/DTensor ratios; target: step time <= 0.85x.

    .venv/bin/python benchmarks/train_2d.py --reps 10 --json train_2d.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
from torchtp.cli._launch import launch

BATCH, SEQ = 2, 64  # per DP rank


def _torchtp(cfg: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    import torchtp

    model = torchtp.DistributedModelWrapper(build_llama().train(), plan=HF_PLAN)
    for layer in model.model.layers:
        fully_shard(layer, mesh=cfg.mesh["dp"])
    return fully_shard(model, mesh=cfg.mesh["dp"])


def _dtensor(cfg: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    model = parallelize_module(build_llama().train(), cfg.mesh["tp"],
                               {p: styles[s]() for p, s in HF_PLAN.items()})
    for layer in model.model.layers:
        fully_shard(layer, mesh=cfg.mesh["dp"])
    return fully_shard(model, mesh=cfg.mesh["dp"])


def _dtensor_clip(parameters: Any, max_norm: float) -> torch.Tensor:
    """torch's clip for a model whose DTensor grads live on two meshes (2-D TP+FSDP
    weights, 1-D FSDP-only norms): one norm per mesh, combined (torchtitan's recipe);
    ``torch.nn.utils.clip_grad_norm_`` refuses to stack norms of different meshes."""
    params = [p for p in parameters if p.grad is not None]
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        by_mesh.setdefault(p.grad.device_mesh, []).append(p.grad)
    norms = [torch.nn.utils.get_total_norm(g).full_tensor() for g in by_mesh.values()]
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    for p in params:  # per tensor: foreach ops refuse DTensors of different meshes
        p.grad.mul_(coef)
    return total


def _stepper(name: str, cfg: Any) -> Any:
    import torchtp

    model = _torchtp(cfg) if name == "torchtp" else _dtensor(cfg)
    clip = torchtp.clip_grad_norm_ if name == "torchtp" else _dtensor_clip
    # foreach=False for both: DTensor's foreach kernels refuse a list mixing meshes.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    g = torch.Generator().manual_seed(cfg.dp_rank)
    ids = torch.randint(0, SMALL["vocab_size"], (BATCH, SEQ), generator=g)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        clip(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _timed(fn: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _quiet() -> Any:
    import torchtp

    warnings.filterwarnings("ignore")
    return torchtp.init_tensor_parallel(tp_size=2)


def _time_rank(rank: int, world: int, reps: int) -> dict[str, list[float]]:
    cfg = _quiet()
    steps = {n: _stepper(n, cfg) for n in ("torchtp", "dtensor")}
    for step in steps.values():
        step()  # warm-up
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps):
        for name in names[rep % 2:] + names[:rep % 2]:
            times[name].append(_timed(steps[name]))
    return times


def _rss_rank(rank: int, world: int, name: str, reps: int) -> float:
    step = _stepper(name, _quiet())
    for _ in range(reps):
        step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux: KiB)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=10, help="interleaved repetitions")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    print(f"dp 2 x tp 2: {args.reps} interleaved repetitions ...", file=sys.stderr, flush=True)
    per_rank = launch(_time_rank, 4, args.reps, timeout=3600)
    ms = {n: statistics.median(max(ts) for ts in zip(*[r[n] for r in per_rank], strict=True)) * 1e3
          for n in per_rank[0]}
    rss = {n: max(launch(_rss_rank, 4, n, 3, timeout=1800)) for n in ms}
    lines = ["| variant | step ms | peak RSS / rank MiB |", "|---|---|---|"]
    lines += [f"| {n} | {ms[n]:.1f} | {rss[n]:.0f} |" for n in ms]
    ratio_t, ratio_m = ms["torchtp"] / ms["dtensor"], rss["torchtp"] / rss["dtensor"]
    lines.append(f"\ntorchtp / DTensor: step time {ratio_t:.2f}x (target <= 0.85x), "
                 f"peak RSS {ratio_m:.2f}x")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"model": SMALL, "batch_per_dp_rank": BATCH, "seq": SEQ, "reps": args.reps,
             "step_ms": ms, "peak_rss_mib": rss, "time_ratio": ratio_t, "rss_ratio": ratio_m,
             "loadavg_after": os.getloadavg()}, indent=2))


if __name__ == "__main__":
    main()
