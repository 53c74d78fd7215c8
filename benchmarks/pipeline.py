"""Pipeline parallelism (issue 23): step time, memory per rank and the bubble at pp 1, 2, 4.

The small Llama of ``benchmarks/_llama.py`` with 8 decoder layers (hidden 512,
vocabulary 2048), float32, a training step (forward, backward, AdamW) on an
8 x 64 batch, on Gloo processes of one thread each, spawned by the script:

* ``pp 1``: the plain model in one process: the whole batch at once, and the
  batch in m = 4 and 8 chunks with gradients accumulated (the pipeline's
  work on one core, so that microbatching's own cost is seen apart from the
  bubble), interleaved;
* ``pp 2`` / ``pp 4``: ``torchtp.pipeline.decoder_stage(model, rank, pp)`` (the
  default balanced split: 4 + 4 and 2 + 2 + 2 + 2 layers) and
  ``PipelineSchedule(stage, m, schedule)`` for GPipe and 1F1B at m = 4 and 8
  microbatches, the four variants built on the same stage and timed in one run,
  interleaved (order rotated every repetition, a barrier before every step).

Step time: from the barrier's release (the earliest rank's) to the last rank's
end of the optimizer step; the median over repetitions. Per rank, its own end.
Minor page faults per step (``ru_minflt``) show where fresh memory is touched
(a schedule holding more microbatches' activations at once faults more).

Bubble: during the timed steps the stage's compute is timed in place, the
wall time of every ``forward_one_chunk`` and ``backward_one_chunk`` of
PyTorch's ``PipelineStage`` (one microbatch's forward or backward through the
stage; the schedules call nothing else that computes, but the loss of the last
stage, a cross-entropy over the logits). Waits for receives, sends and the
schedule's own bookkeeping are left out. A rank's bubble is
``1 - compute / span``, with span the pipeline step's (``PipelineSchedule.step``,
no optimizer) from the earliest rank's start to the last rank's end, on the
machine's monotonic clock that every process shares; compared with the
schedule's theoretical ``(p - 1) / (m + p - 1)`` (equal stages, no
communication). pp 4 runs 4 processes on 2 cores: oversubscribed, its stages
wait for a core as well as for each other, which the in-place timer counts as
compute (a forward preempted mid-way takes longer), so its bubble is labelled.

Memory: each (pp, schedule) in fresh processes (peak RSS never goes down), two
steps at m = 8: this rank's parameter bytes and AdamW state bytes (every
tensor of ``optimizer.state``, counted), the ratio of the largest rank's
parameters + state to ``1/pp`` of pp 1's (target <= 1.1), and the peak RSS
above the resident memory after imports and the group's start (pp 1: the
whole batch). A parameter count on the meta device (:data:`SHAPES`) gives the
same ratio for a larger vocabulary and two public Llama shapes at pp 2, 4, 8,
for the default split and for the explicit ``split=[...]`` whose largest stage
is smallest (:func:`torchtp.pipeline.balance.param_balanced_split`, what ``split="params"`` uses).

    .venv/bin/python benchmarks/pipeline.py [--reps 10] [--json pipeline.json]
    .venv/bin/python benchmarks/pipeline.py --quick     # smoke run: pp 1 and 2, few steps
"""

from __future__ import annotations

import argparse
import functools
import itertools
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
from _llama import SMALL, build_llama
from moe_memory import _peak_bytes, _resident_bytes  # the same peak-RSS measure
from torchtp.cli._launch import launch
from torchtp.pipeline import PipelineSchedule, decoder_stage, stage_layers
from torchtp.pipeline.balance import param_balanced_split

LAYERS = 8
BATCH, SEQ = 8, 64
SCHEDULES = ("gpipe", "1f1b")
MICRO = (4, 8)
MIB = 2**20

# The stage's compute time of this process's current step (seconds), see _time_chunks.
_busy = [0.0]


def _time_chunks() -> None:
    """Add every microbatch forward and backward of ``PipelineStage`` to ``_busy``.

    Wrapped on the class, so the timer sees the schedules' own calls whatever
    torchtp keeps its ``PipelineStage`` in.
    """
    from torch.distributed.pipelining import PipelineStage

    def timed(method: Any) -> Any:
        @functools.wraps(method)
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                _busy[0] += time.perf_counter() - start
        return run

    for name in ("forward_one_chunk", "backward_one_chunk"):
        setattr(PipelineStage, name, timed(getattr(PipelineStage, name)))


def _batch(seq: int) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (BATCH, seq),
                         generator=torch.Generator().manual_seed(1))  # (B, T)


def _stepper(rank: int, pp: int, schedule: str, micro: int, layers: int) -> Any:
    """``(step, params, optimizer)``: step runs forward + backward, returns the loss or None."""
    model = build_llama(num_hidden_layers=layers).train()
    if pp == 1:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def whole(ids: torch.Tensor) -> torch.Tensor:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            return loss.detach()

        return whole, model, opt
    stage = decoder_stage(model, rank, pp)
    pipe = PipelineSchedule(stage, micro, schedule)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-4)
    return (lambda ids: pipe.step(ids, labels=ids)), stage, opt


def _accumulated(model: torch.nn.Module, micro: int) -> Any:
    """One process, the batch in ``micro`` chunks, gradients accumulated (the pipeline's work)."""
    def step(ids: torch.Tensor) -> None:
        for chunk in ids.chunk(micro):  # (B/m, T): equal token counts, so mean / m is exact
            (model(input_ids=chunk, labels=chunk).loss / micro).backward()
    return step


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _time_rank(rank: int, pp: int, reps: int, warmup: int, seq: int,
               layers: int) -> dict[str, Any]:
    """Interleaved timed steps of every variant on this rank: start, ends, compute, faults."""
    warnings.filterwarnings("ignore")
    ids = _batch(seq)
    if pp == 1:
        step, model, opt = _stepper(rank, 1, "", 1, layers)
        variants = {"whole batch": step,
                    **{f"accumulation m={m}": _accumulated(model, m) for m in MICRO}}
    else:
        _time_chunks()
        model = decoder_stage(build_llama(num_hidden_layers=layers).train(), rank, pp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        pipes = {f"{s} m={m}": PipelineSchedule(model, m, s) for s in SCHEDULES for m in MICRO}
        variants = {n: (lambda ids, p=p: p.step(ids, labels=ids)) for n, p in pipes.items()}
    names = list(variants)
    samples: dict[str, list[tuple[float, ...]]] = {n: [] for n in names}
    for rep in range(warmup + reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            if pp > 1:
                dist.barrier()
            _busy[0] = 0.0
            faults, start = _faults(), time.perf_counter()
            variants[name](ids)
            piped = time.perf_counter()
            busy = _busy[0] if pp > 1 else piped - start  # one process: never idle
            opt.step()
            opt.zero_grad()
            if rep >= warmup:
                samples[name].append((start, piped, time.perf_counter(), busy,
                                      _faults() - faults))
    return {"samples": samples}


def _memory_rank(rank: int, pp: int, schedule: str, seq: int, layers: int) -> dict[str, Any]:
    """Two steps at m = max(MICRO) in fresh processes: parameter, AdamW state and peak bytes."""
    warnings.filterwarnings("ignore")
    base, import_peak = _resident_bytes(), _peak_bytes()
    step, model, opt = _stepper(rank, pp, schedule, max(MICRO), layers)
    ids = _batch(seq)
    for _ in range(2):
        step(ids)
        opt.step()
        opt.zero_grad()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(v.numel() * v.element_size() for s in opt.state.values()
                for v in s.values() if torch.is_tensor(v))
    return {"params": params, "state": state, "peak": _peak_bytes() - base,
            "peak_rss": _peak_bytes(), "known": _peak_bytes() > import_peak}


def _summary(pp: int, name: str, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repetitions: step and pipeline spans, per-rank step, compute and bubble."""
    reps = list(zip(*[r["samples"][name] for r in per_rank], strict=True))  # (rep, rank, 5)
    span = [max(r[2] for r in rep) - min(r[0] for r in rep) for rep in reps]
    piped = [max(r[1] for r in rep) - min(r[0] for r in rep) for rep in reps]
    own = [[r[2] - min(x[0] for x in rep) for r in rep] for rep in reps]
    bubble = [[1 - r[3] / p for r in rep] for rep, p in zip(reps, piped, strict=True)]
    micro = int(name.split("m=")[1]) if "m=" in name else 1
    med = statistics.median
    return {"pp": pp, "variant": name, "m": micro, "step_ms": med(span) * 1e3,
            "pipeline_ms": med(piped) * 1e3,
            "rank_step_ms": [med(c) * 1e3 for c in zip(*own, strict=True)],
            "rank_compute_ms": [med(r[3] for r in c) * 1e3 for c in zip(*reps, strict=True)],
            "rank_bubble": [med(c) for c in zip(*bubble, strict=True)],
            "rank_faults": [med(r[4] for r in c) for c in zip(*reps, strict=True)],
            "bubble": med(statistics.mean(b) for b in bubble),
            "theory": (pp - 1) / (micro + pp - 1)}


# Shapes for the parameter-balance check (meta device, no weights): the benchmarked
# model, the same with a 32000 vocabulary, and two public Llama shapes.
SHAPES = {
    "this benchmark's": {"num_hidden_layers": LAYERS},
    "same, vocabulary 32000": {"num_hidden_layers": LAYERS, "vocab_size": 32000},
    "Llama-2-7B shape": {"num_hidden_layers": 32, "hidden_size": 4096,
                         "intermediate_size": 11008, "num_attention_heads": 32,
                         "num_key_value_heads": 32, "vocab_size": 32000},
    "Llama-3-8B shape": {"num_hidden_layers": 32, "hidden_size": 4096,
                         "intermediate_size": 14336, "num_attention_heads": 32,
                         "num_key_value_heads": 8, "vocab_size": 128256},
}


def _parts(shape: dict[str, Any]) -> tuple[int, list[int], int]:
    """Parameters of the embedding, of each decoder layer, of the final norm + LM head."""
    with torch.device("meta"):
        model = build_llama(**shape)
    layers = [0] * shape["num_hidden_layers"]
    first = last = 0
    for name, p in model.named_parameters():
        if name.startswith("model.layers."):
            layers[int(name.split(".")[2])] += p.numel()
        elif name.startswith("model.embed_tokens."):
            first += p.numel()
        else:  # model.norm, lm_head
            last += p.numel()
    return first, layers, last


def _stage_sizes(parts: tuple[int, list[int], int], pp: int,
                 split: list[int] | None) -> list[int]:
    """Parameters per stage as ``decoder_stage(..., split)`` keeps them."""
    first, layers, last = parts
    sizes = [sum(layers[i] for i in r) for r in stage_layers(len(layers), pp, split)]
    sizes[0] += first
    sizes[-1] += last
    return sizes


def _split_check(pps: tuple[int, ...], quick: bool) -> list[dict[str, Any]]:
    """Largest stage's parameters / (total / pp): default split and the balanced explicit one.

    AdamW's state is two float32 copies of every parameter (plus a scalar step
    each), so parameters + state have the same ratio.
    """
    rows = []
    for label, shape in SHAPES.items():
        if quick and label != "this benchmark's":
            continue
        parts = _parts(shape)
        total = parts[0] + sum(parts[1]) + parts[2]
        for pp in sorted({*pps, 2, 4, 8} - {1}):
            if pp > len(parts[1]):
                continue
            split = param_balanced_split(*parts, pp)
            rows.append({"model": label, "parameters": total, "pp": pp,
                         "default_split": [len(r) for r in stage_layers(len(parts[1]), pp)],
                         "default": max(_stage_sizes(parts, pp, None)) / (total / pp),
                         "balanced_split": split,
                         "balanced": max(_stage_sizes(parts, pp, split)) / (total / pp)})
    return rows


def _per_rank(values: list[float], fmt: str) -> str:
    return " / ".join(format(v, fmt) for v in values)


def _tables(times: list[dict[str, Any]], memory: dict[str, list[dict[str, Any]]],
            splits: list[dict[str, Any]], layers: int) -> str:
    one = memory["pp 1"][0]
    lines = ["Step time and bubble (medians; per rank: rank 0 / 1 / ...; pp 4 oversubscribes "
             "the 2 cores)", "",
             "| pp | schedule | m | step ms | step ms per rank | compute ms per rank "
             "| page faults per step per rank (k) | bubble per rank | bubble | (p-1)/(m+p-1) "
             "| difference |", "|---:|---|---:|---:|---|---|---|---|---:|---:|---:|"]
    for t in times:
        label = f"{t['pp']}" + (" (oversubscribed)" if t["pp"] > 2 else "")
        sched = t["variant"].partition(" m=")[0]
        bubble = (f"| {_per_rank([100 * b for b in t['rank_bubble']], '.0f')} % "
                  f"| {100 * t['bubble']:.1f} % | {100 * t['theory']:.1f} % "
                  f"| {100 * (t['bubble'] - t['theory']):+.1f} pp |") if t["pp"] > 1 \
            else "| - | - | - | - |"
        lines.append(
            f"| {label} | {sched} | {t['m']} | {t['step_ms']:.0f} "
            f"| {_per_rank(t['rank_step_ms'], '.0f')} | {_per_rank(t['rank_compute_ms'], '.0f')} "
            f"| {_per_rank([f / 1e3 for f in t['rank_faults']], '.1f')} {bubble}")
    lines += ["", f"Memory per rank (fresh processes, 2 steps at m = {max(MICRO)}; MiB; "
              "target: largest rank's params + state <= 1.1 x pp 1's / pp)", "",
              "| pp | schedule | params per rank | AdamW state per rank "
              "| largest (params + state) / (pp 1's / pp) | peak RSS above start per rank |",
              "|---:|---|---|---|---:|---|"]
    for name, per_rank in memory.items():
        pp = len(per_rank)
        largest = max(r["params"] + r["state"] for r in per_rank)
        ratio = largest / ((one["params"] + one["state"]) / pp)
        peaks = " / ".join(("" if r["known"] else "<= ") + f"{r['peak'] / MIB:.0f}"
                           for r in per_rank)
        lines.append(f"| {pp} | {name.partition(', ')[2] or '-'} "
                     f"| {_per_rank([r['params'] / MIB for r in per_rank], '.1f')} "
                     f"| {_per_rank([r['state'] / MIB for r in per_rank], '.1f')} "
                     f"| {ratio:.3f} | {peaks} |")
    lines += ["", "Largest stage's parameters / (total / pp), counted on the meta device "
              "(target <= 1.1)", "",
              "| model | parameters | pp | default split | ratio | balanced explicit split "
              "| ratio |", "|---|---:|---:|---|---:|---|---:|"]
    lines += [f"| {s['model']} | {s['parameters'] / 1e6:,.1f} M | {s['pp']} "
              f"| {s['default_split']} | {s['default']:.3f} | {s['balanced_split']} "
              f"| {s['balanced']:.3f} |" for s in splits]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=10, help="interleaved timed repetitions")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repetitions first")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: pp 1 and 2, 2 layers, sequence 16, 2 repetitions")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    pps, layers, seq = ((1, 2), 2, 16) if args.quick else ((1, 2, 4), LAYERS, SEQ)
    reps, warmup = (2, 1) if args.quick else (args.reps, args.warmup)
    load_before = os.getloadavg()
    times: list[dict[str, Any]] = []
    for pp in pps:
        print(f"pp {pp}: {reps} interleaved repetitions ...", file=sys.stderr, flush=True)
        per_rank = launch(_time_rank, pp, reps, warmup, seq, layers, timeout=1800)
        times += [_summary(pp, n, per_rank) for n in per_rank[0]["samples"]]
    print("memory runs ...", file=sys.stderr, flush=True)
    memory = {"pp 1": launch(_memory_rank, 1, "", seq, layers, timeout=600)}
    for pp, schedule in itertools.product(pps[1:], SCHEDULES):
        memory[f"pp {pp}, {schedule}"] = launch(_memory_rank, pp, schedule, seq, layers,
                                                timeout=600)
    splits = _split_check(pps, args.quick)
    load_after = os.getloadavg()
    print(_tables(times, memory, splits, layers))
    print("load average (1, 5, 15 min) before " + ", ".join(f"{v:.2f}" for v in load_before)
          + "; after " + ", ".join(f"{v:.2f}" for v in load_after))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"model": {**SMALL, "num_hidden_layers": layers}, "batch": BATCH, "seq": seq,
             "reps": reps, "times": times, "memory": memory, "splits": splits,
             "loadavg_before": load_before, "loadavg_after": load_after}, indent=2))


if __name__ == "__main__":
    main()
