"""A dp 2 x tp 2 training step: torchtp + FSDP2 vs PyTorch DTensor TP + FSDP2.

One run, 4 Gloo CPU processes (one thread each), the small Llama of
benchmarks/_llama.py with the same random weights everywhere, on the mesh of
``init_tensor_parallel(tp_size=2)``. What each side runs:

* torchtp: ``DistributedModelWrapper(model, plan=HF_PLAN)`` (q/k/v/gate/up
  ``colwise``, o/down ``rowwise``), then ``fully_shard(block, mesh=cfg.mesh["dp"])``
  per decoder block and on the root (docs/training.md's recipe);
  ``torchtp.clip_grad_norm_(model.parameters(), 1.0)``.
* DTensor: ``parallelize_module(model, cfg.mesh["tp"], ColwiseParallel/RowwiseParallel
  for the same plan)``, the same ``fully_shard`` calls; one gradient norm per
  mesh combined (torchtitan's recipe; ``torch.nn.utils.clip_grad_norm_`` refuses
  gradients on two meshes), the same max norm 1.0.
* Both: ``AdamW(lr=1e-4, foreach=False)`` (DTensor's foreach kernels refuse a
  list mixing meshes; on CPU ``foreach=None`` also picks the per-tensor path),
  the same batch per DP rank. The first step's loss and gradient norm must
  agree between the two sides (checked), so both train the same model.

A step is forward + backward + clip + AdamW. Both variants live in the same
processes and are timed in interleaved repetitions (barrier before every
step). Per repetition: wall time of the slowest rank, and CPU time (process
time, Gloo's threads included) of each rank; medians over repetitions. The
target (torchtp <= 0.85x DTensor) is on wall step time; CPU time is reported
beside it because on a shared machine it moves less with other jobs' load.
Per phase (forward, backward, clip, optimizer) CPU times show where the time
goes, and one step's collectives are counted per kind (CommDebugMode sees
torchtp's, DTensor's and FSDP2's alike). Peak RSS is measured in two further
runs, one variant each (a process's peak cannot be split between two variants).

    .venv/bin/python benchmarks/train_2d.py --reps 10 --json train_2d.json
    .venv/bin/python benchmarks/train_2d.py --profile torchtp   # where the time goes
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
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


PHASES = ("forward", "backward", "clip", "optimizer")


def _stepper(name: str, cfg: Any) -> Any:
    """A step function returning ``(loss, grad norm, CPU seconds per phase)``."""
    import torchtp

    model = _torchtp(cfg) if name == "torchtp" else _dtensor(cfg)
    clip = torchtp.clip_grad_norm_ if name == "torchtp" else _dtensor_clip
    # foreach=False for both: DTensor's foreach kernels refuse a list mixing meshes.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    g = torch.Generator().manual_seed(cfg.dp_rank)
    ids = torch.randint(0, SMALL["vocab_size"], (BATCH, SEQ), generator=g)

    def step() -> tuple[torch.Tensor, torch.Tensor, list[float]]:
        marks = [time.process_time()]
        loss = model(input_ids=ids, labels=ids).loss
        marks.append(time.process_time())
        loss.backward()
        marks.append(time.process_time())
        norm = clip(model.parameters(), 1.0)
        marks.append(time.process_time())
        opt.step()
        opt.zero_grad(set_to_none=True)
        marks.append(time.process_time())
        return loss.detach(), norm, [b - a for a, b in itertools.pairwise(marks)]

    return step


def _timed(fn: Any) -> tuple[float, list[float]]:
    dist.barrier()
    start = time.perf_counter()
    _, _, phases = fn()
    return time.perf_counter() - start, phases


def _quiet() -> Any:
    import torchtp

    warnings.filterwarnings("ignore")
    return torchtp.init_tensor_parallel(tp_size=2)


# The dispatcher's collective ops (eager c10d and DTensor's functional ones) by kind.
_KINDS = {"allreduce_": "all_reduce", "all_reduce": "all_reduce",
          "_allgather_base_": "all_gather", "all_gather_into_tensor": "all_gather",
          "allgather_": "all_gather_object", "_reduce_scatter_base_": "reduce_scatter",
          "reduce_scatter_tensor": "reduce_scatter", "broadcast_": "broadcast"}


def _collectives(step: Any) -> dict[str, int]:
    """Collectives of one step by kind: torchtp's, DTensor's and FSDP2's alike.

    A bare dispatch mode, not ``CommDebugMode``: its module tracker re-wraps every
    module's inputs, which would hide that q/k/v share one input.
    """
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: dict[str, int] = {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            if any(t is DTensor for t in types):
                return NotImplemented  # let DTensor run: its collectives come back here
            if getattr(func, "namespace", None) in ("c10d", "_c10d_functional"):
                name = func.__name__.split(".")[0]
                if name not in ("wait_tensor", "_wrap_tensor_autograd"):  # not collectives
                    kind = _KINDS.get(name, name)
                    counts[kind] = counts.get(kind, 0) + 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    return counts


def _time_rank(rank: int, world: int, reps: int) -> dict[str, Any]:
    cfg = _quiet()
    steps = {n: _stepper(n, cfg) for n in ("torchtp", "dtensor")}
    first = {n: [float(v) for v in step()[:2]] for n, step in steps.items()}  # + warm-up
    counts = {n: _collectives(step) for n, step in steps.items()}
    names = list(steps)
    wall: dict[str, list[float]] = {n: [] for n in names}
    phases: dict[str, list[list[float]]] = {n: [] for n in names}
    for rep in range(reps):
        for name in names[rep % 2:] + names[:rep % 2]:
            seconds, cpu = _timed(steps[name])
            wall[name].append(seconds)
            phases[name].append(cpu)
    return {"wall": wall, "phases": phases, "first": first, "counts": counts}


def _rss_rank(rank: int, world: int, name: str, reps: int) -> float:
    step = _stepper(name, _quiet())
    for _ in range(reps):
        step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux: KiB)


def _profile_rank(rank: int, world: int, name: str, steps: int) -> str:
    """cProfile (CPU-time clock) of ``steps`` steps of one variant after a warm-up step."""
    import cProfile
    import io
    import pstats

    step = _stepper(name, _quiet())
    step()
    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(60)
    return out.getvalue()


def _median_phases(per_rank: list[dict[str, Any]], name: str) -> list[float]:
    """Per phase: median over repetitions of the mean over ranks, milliseconds."""
    reps = list(zip(*[r["phases"][name] for r in per_rank], strict=True))  # (rep, rank, phase)
    return [statistics.median(statistics.mean(rank[i] for rank in rep) for rep in reps) * 1e3
            for i in range(len(PHASES))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=10, help="interleaved repetitions")
    parser.add_argument("--no-rss", action="store_true", help="skip the two peak-RSS runs")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--profile", choices=("torchtp", "dtensor"),
                        help="instead: print rank 0's cProfile (CPU time) of 5 steps of one variant")
    args = parser.parse_args()
    if args.profile:
        print(launch(_profile_rank, 4, args.profile, 5, timeout=1800)[0])
        return
    load_before = os.getloadavg()
    print(f"dp 2 x tp 2: {args.reps} interleaved repetitions ...", file=sys.stderr, flush=True)
    per_rank = launch(_time_rank, 4, args.reps, timeout=3600)
    names = list(per_rank[0]["wall"])
    (loss_t, norm_t), (loss_d, norm_d) = (per_rank[0]["first"][n] for n in names)
    if not (math.isclose(loss_t, loss_d, rel_tol=1e-4) and math.isclose(norm_t, norm_d,
                                                                       rel_tol=1e-4)):
        raise SystemExit(f"the two sides do not train the same model: first loss {loss_t} vs "
                         f"{loss_d}, gradient norm {norm_t} vs {norm_d}")
    ms = {n: statistics.median(max(ts) for ts in zip(*[r["wall"][n] for r in per_rank],
                                                    strict=True)) * 1e3 for n in names}
    phases = {n: _median_phases(per_rank, n) for n in names}
    cpu = {n: statistics.median(statistics.mean(sum(p) for p in ranks) for ranks in
                                zip(*[r["phases"][n] for r in per_rank], strict=True)) * 1e3
           for n in names}
    rss = ({n: max(launch(_rss_rank, 4, n, 3, timeout=1800)) for n in names}
           if not args.no_rss else {n: float("nan") for n in names})
    load_after = os.getloadavg()
    lines = ["| variant | wall step ms | CPU ms / step / rank | "
             + " | ".join(f"{p} CPU ms" for p in PHASES) + " | peak RSS / rank MiB |",
             "|---|---|---|" + "---|" * len(PHASES) + "---|"]
    lines += [f"| {n} | {ms[n]:.1f} | {cpu[n]:.1f} | "
              + " | ".join(f"{v:.1f}" for v in phases[n]) + f" | {rss[n]:.0f} |" for n in names]
    ratio_t, ratio_c = ms["torchtp"] / ms["dtensor"], cpu["torchtp"] / cpu["dtensor"]
    ratio_m = rss["torchtp"] / rss["dtensor"]
    lines.append(f"\ntorchtp / DTensor: wall step time {ratio_t:.2f}x (target <= 0.85x), "
                 f"CPU time {ratio_c:.2f}x, peak RSS {ratio_m:.2f}x")
    lines.append(f"first loss {loss_t:.6f} / {loss_d:.6f}, gradient norm {norm_t:.6f} / "
                 f"{norm_d:.6f} (torchtp / DTensor)")
    for n in names:
        lines.append(f"collectives per step, {n}: " + ", ".join(
            f"{op} {k}" for op, k in sorted(per_rank[0]["counts"][n].items())))
    lines.append("load average (1, 5, 15 min) before "
                 + ", ".join(f"{v:.2f}" for v in load_before) + "; after "
                 + ", ".join(f"{v:.2f}" for v in load_after))
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"model": SMALL, "batch_per_dp_rank": BATCH, "seq": SEQ, "reps": args.reps,
             "step_ms": ms, "cpu_ms": cpu, "phase_cpu_ms": phases, "peak_rss_mib": rss,
             "time_ratio": ratio_t, "cpu_ratio": ratio_c, "rss_ratio": ratio_m,
             "collectives": per_rank[0]["counts"], "loadavg_before": load_before,
             "loadavg_after": load_after}, indent=2))


if __name__ == "__main__":
    main()
