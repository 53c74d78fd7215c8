"""A training step with and without communication overlap, at tp 2 and tp 4.

The small Llama of benchmarks/_llama.py (same random weights on every rank),
``DistributedModelWrapper(model, plan=HF_PLAN)``, one Gloo process per rank
(one torch thread each) on CPU by default. A step is forward + backward +
SGD. Variants (``TP_OVERLAP``, read afresh before each step; see
``torchtp.comm.overlap``):

* ``plain``: no overlap; ``grad_reduce``: the weight-rows-split projections'
  input-gradient all-reduce runs beside their weight gradients;
* with sequence parallelism (``sequence_parallel=True``): ``sp plain``,
  ``sp grad_reduce`` (also the re-gather of the input shard beside the input
  gradient, and the input gradient's reduce-scatter beside the last weight
  gradient), ``sp sequence`` (the blocks' all-gathers and reduce-scatters in
  ``--chunks`` pieces, each beside the previous piece's product), ``sp both``.

Variants sharing a model (with or without sequence parallelism) are timed in
interleaved repetitions, the order rotating each repetition, a barrier before
every step. Per repetition: the slowest rank's wall time, and each rank's CPU
time (Gloo's threads included); medians over repetitions, and the ratio to the
variant without overlap taken within each repetition (median and quartiles). Before timing, one
step of every variant without the update checks that all variants compute the
same loss and gradient norm. Prints the load average before and after.

    .venv/bin/python benchmarks/overlap.py --reps 15 --json overlap.json
    .venv/bin/python benchmarks/overlap.py --tp 2 --reps 3     # quick look
    .venv/bin/python benchmarks/overlap.py --backend nccl      # one GPU per rank
"""

from __future__ import annotations

import argparse
import json
import math
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
from torchtp.cli._launch import launch

BATCH, SEQ = 2, 128
# name -> (TP_OVERLAP, sequence parallel)
VARIANTS: dict[str, tuple[str, bool]] = {
    "plain": ("0", False), "grad_reduce": ("grad_reduce", False),
    "sp plain": ("0", True), "sp grad_reduce": ("grad_reduce", True),
    "sp sequence": ("sequence", True), "sp both": ("1", True),
}


def _switch(value: str) -> None:
    from torchtp.comm import overlap

    os.environ[overlap.ENV] = value
    overlap.reset()


def _models(device: torch.device) -> dict[bool, Any]:
    """One wrapped model (and its SGD) per sequence-parallel setting, the same weights."""
    import torchtp

    out = {}
    for sp in (False, True):
        model = build_llama().train().to(device)
        model = torchtp.DistributedModelWrapper(model, plan=HF_PLAN, sequence_parallel=sp)
        out[sp] = (model, torch.optim.SGD(model.parameters(), lr=1e-4))
    return out


def _step(model: Any, opt: Any, ids: torch.Tensor, update: bool = True) -> tuple[float, float]:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
    if update:
        opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss), norm


def _counts(model: Any, opt: Any, ids: torch.Tensor) -> dict[str, int]:
    import torchtp

    with torchtp.count_collectives() as counted:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    opt.zero_grad(set_to_none=True)
    return dict(counted.counts)


def _rank(rank: int, world: int, reps: int, chunks: int, backend: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    os.environ["TP_OVERLAP_CHUNKS"] = str(chunks)
    models = _models(device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SMALL["vocab_size"], (BATCH, SEQ), generator=g).to(device)
    first, counts = {}, {}
    for name, (value, sp) in VARIANTS.items():  # warm-up, equal losses, collectives
        _switch(value)
        first[name] = _step(*models[sp], ids, update=False)
        counts[name] = _counts(*models[sp], ids)
    names = list(VARIANTS)
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            value, sp = VARIANTS[name]
            _switch(value)
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            _step(*models[sp], ids)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return {"wall": wall, "cpu": cpu, "first": first, "counts": counts}


def _table(tp: int, per_rank: list[dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    names = list(VARIANTS)
    slowest = {n: [max(ts) for ts in zip(*[r["wall"][n] for r in per_rank], strict=True)]
               for n in names}  # per repetition
    ms = {n: statistics.median(slowest[n]) * 1e3 for n in names}
    cpu = {n: statistics.median(statistics.mean(ts) for ts in
                                zip(*[r["cpu"][n] for r in per_rank], strict=True)) * 1e3
           for n in names}
    base = {False: "plain", True: "sp plain"}
    lines = [f"\ntp {tp}: median step (forward + backward + SGD), batch {BATCH} x {SEQ} tokens",
             "| variant | wall ms | vs no overlap | paired ratio, median [quartiles] "
             "| CPU ms / rank | collectives / step |",
             "|---|---|---|---|---|---|"]
    paired = {}
    for n in names:
        ref = base[VARIANTS[n][1]]
        # The ratio within each repetition (the two ran one after the other), then quartiles.
        ratios = [a / b for a, b in zip(slowest[n], slowest[ref], strict=True)]
        q1, med, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        paired[n] = (q1, med, q3)
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(per_rank[0]["counts"][n].items()))
        lines.append(f"| {n} | {ms[n]:.1f} | {ms[n] / ms[ref]:.3f}x | {med:.3f}x "
                     f"[{q1:.3f}, {q3:.3f}] | {cpu[n]:.1f} | {kinds} |")
    return lines, {"step_ms": ms, "cpu_ms": cpu, "paired_ratio_quartiles": paired,
                   "counts": per_rank[0]["counts"], "first": per_rank[0]["first"]}


def _check_same(tp: int, first: dict[str, tuple[float, float]]) -> None:
    loss, norm = first["plain"]
    for name, (l2, n2) in first.items():
        if not (math.isclose(l2, loss, rel_tol=1e-5) and math.isclose(n2, norm, rel_tol=1e-4)):
            raise SystemExit(f"tp {tp}: {name} computes loss {l2} / gradient norm {n2}, "
                             f"plain {loss} / {norm}: the variants must train the same model")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--reps", type=int, default=15, help="interleaved repetitions")
    parser.add_argument("--chunks", type=int, default=2, help="TP_OVERLAP_CHUNKS")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    load_before = os.getloadavg()
    results, lines = {}, []
    for tp in args.tp:
        print(f"tp {tp}: {args.reps} interleaved repetitions of {len(VARIANTS)} variants ...",
              file=sys.stderr, flush=True)
        per_rank = launch(_rank, tp, args.reps, args.chunks, args.backend, backend=args.backend,
                          timeout=3600)
        _check_same(tp, per_rank[0]["first"])
        table, results[tp] = _table(tp, per_rank)
        lines += table
    load_after = os.getloadavg()
    device = (torch.cuda.get_device_name(0) if args.backend == "nccl"
              else f"CPU, {os.cpu_count()} cores, one torch thread per rank")
    lines.append(f"\n{args.backend} on {device}; torch {torch.__version__}; chunks {args.chunks}")
    lines.append("load average (1, 5, 15 min) before " + ", ".join(f"{v:.2f}" for v in load_before)
                 + "; after " + ", ".join(f"{v:.2f}" for v in load_after))
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"model": SMALL, "batch": BATCH, "seq": SEQ, "reps": args.reps,
             "chunks": args.chunks, "backend": args.backend, "device": device,
             "results": results, "loadavg_before": load_before, "loadavg_after": load_after},
            indent=2, default=str))


if __name__ == "__main__":
    main()
