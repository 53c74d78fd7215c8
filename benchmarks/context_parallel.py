"""Context parallelism: activation memory, longest sequence in a budget, step time per rank.

One training step (forward with ``labels=``, backward, SGD) of a Llama on Gloo
CPU processes (one thread each) at cp 1 (plain transformers, SDPA: the
one-process reference) and, under ``torchtp.cp.ContextParallel``, at cp 2 and
4 with each algorithm (``allgather``, ``ulysses``, ``ring``).

Memory is the bytes autograd saves for the backward (unique storages, not
parameters, measured with ``saved_tensors_hooks``): deterministic on any
machine. "attention" counts what is saved inside the attention function
(transformers' SDPA, or torchtp's context-parallel attention), "step" every
activation of the step plus the logits. "peak" is the most memory live at
once during a step beyond the parameters and their gradients (every
storage an operator allocates, counted until it is freed, with
``TorchDispatchMode``): the saved activations plus what a layer holds only
while it runs (all-gather's keys and values of the whole sequence and its
mask; ring's two blocks). "longest" is the longest sequence
(a multiple of 512) whose step saves at most ``--budget-mib`` per rank. Time
is the median over interleaved repetitions of the slowest rank's step.
Ratios are from the same run.

    .venv/bin/python benchmarks/context_parallel.py [--seq 1024] [--kv 8] [--cp 1,2,4]
        [--budget-mib 48] [--reps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from torchtp.cli._launch import launch

MODEL = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
         "intermediate_size": 512, "vocab_size": 2048}
ALGORITHMS = ("allgather", "ulysses", "ring")


def _build(kv: int, seq: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**MODEL, num_key_value_heads=kv, max_position_embeddings=seq)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    model.set_attn_implementation("sdpa")
    return model


class _Saved:
    """Bytes autograd saves, in total and inside attention calls (unique storages)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.all: dict[int, int] = {}
        self.attention: dict[int, int] = {}
        self.inside = False

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.params:
            size = t.untyped_storage().nbytes()
            self.all[ptr] = size
            if self.inside:
                self.attention[ptr] = size
        return t

    def around(self, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.inside = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside = False
        return counted


class _Live(TorchDispatchMode):
    """The most bytes of storage allocated inside the block that are alive at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for ptr in [p for p, (ref, _) in self.live.items() if ref.expired()]:
            self.now -= self.live.pop(ptr)[1]
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                if st.data_ptr() and st.data_ptr() not in self.live:
                    self.live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
                    self.now += st.nbytes()
        self.peak = max(self.peak, self.now)
        return out


def _peak_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Peak live bytes of one step beyond parameters and gradients (allocated before)."""
    model(input_ids=ids, labels=ids).loss.backward()  # every gradient exists before counting
    live = _Live()
    with live:
        model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    return live.peak


def _model(cp: int, algorithm: str, kv: int, seq: int) -> tuple[torch.nn.Module, Any]:
    """The model to step and the attention function to count inside."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = _build(kv, seq)
    if cp == 1:
        return model, ("sdpa", sdpa_attention_forward)
    from torchtp.cp import ContextParallel
    from torchtp.cp.hf_attention import NAME, cp_attention_forward

    del AttentionInterface  # registered by ContextParallel itself
    return ContextParallel(model, algorithm=algorithm), (NAME, cp_attention_forward)


def _step_bytes(model: torch.nn.Module, attn: tuple[str, Any], ids: torch.Tensor) -> tuple[int, int]:
    from transformers import AttentionInterface

    name, fn = attn
    saved = _Saved(model)
    AttentionInterface.register(name, saved.around(fn))
    try:
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            out = model(input_ids=ids, labels=ids)
    finally:
        AttentionInterface.register(name, fn)
    logits = out.logits
    saved.all.setdefault(logits.untyped_storage().data_ptr(), logits.untyped_storage().nbytes())
    out.loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(saved.attention.values()), sum(saved.all.values())


def _longest(cp: int, algorithm: str, kv: int, budget: int) -> int:
    best, seq = 0, 512
    while seq <= 16384:
        model, attn = _model(cp, algorithm, kv, seq)
        ids = torch.randint(0, MODEL["vocab_size"], (1, seq),
                            generator=torch.Generator().manual_seed(1))
        _, step = _step_bytes(model, attn, ids)
        worst = torch.tensor(step)
        if cp > 1:
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if int(worst) > budget:
            break
        best, seq = seq, seq + 512 * max(1, seq // 2048)
    return best


def _rank(rank: int, world: int, kv: int, seq: int, reps: int,
          budget: int) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    if world > 1:
        import torchtp

        torchtp.init_parallel(cp=world)
    ids = torch.randint(0, MODEL["vocab_size"], (1, seq),
                        generator=torch.Generator().manual_seed(1))
    names = ["one process"] if world == 1 else list(ALGORITHMS)
    models, memory, peak, longest = {}, {}, {}, {}
    for name in names:
        models[name] = _model(world, name, kv, seq)
        memory[name] = _step_bytes(*models[name], ids)
        peak[name] = _peak_bytes(models[name][0], ids)
        longest[name] = _longest(world, name, kv, budget)
    opts = {n: torch.optim.SGD(m.parameters(), lr=1e-4) for n, (m, _) in models.items()}
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            if world > 1:
                dist.barrier()
            start = time.perf_counter()
            models[name][0](input_ids=ids, labels=ids).loss.backward()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            times[name].append(time.perf_counter() - start)
    return {"memory": memory, "peak": peak, "longest": longest, "times": times}


def render(kv: int, seq: int, budget: int, results: dict[int, list[dict[str, Any]]]) -> str:
    one = results[1][0]
    attn1, step1 = one["memory"]["one process"]
    time1 = statistics.median(one["times"]["one process"])
    peak1 = one["peak"]["one process"]
    lines = [f"Llama {MODEL}, {kv} KV heads, batch 1 x {seq} tokens, fp32, Gloo, 1 thread per "
             f"rank; budget for 'longest' {budget / 2**20:.0f} MiB per rank",
             "", "| cp | algorithm | attention MiB/rank | x one process | step activations "
             "MiB/rank | x one process | peak MiB/rank | x one process | longest seq in budget "
             "| step s | x one process |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for cp, per_rank in sorted(results.items()):
        for name in per_rank[0]["memory"]:
            attn = max(r["memory"][name][0] for r in per_rank)
            step = max(r["memory"][name][1] for r in per_rank)
            slowest = [max(ts) for ts in zip(*(r["times"][name] for r in per_rank), strict=True)]
            t = statistics.median(slowest)
            peak = max(r["peak"][name] for r in per_rank)
            lines.append(f"| {cp} | {name} | {attn / 2**20:.1f} | {attn / attn1:.3f} | "
                         f"{step / 2**20:.1f} | {step / step1:.3f} | "
                         f"{peak / 2**20:.1f} | {peak / peak1:.3f} | "
                         f"{per_rank[0]['longest'][name]} | {t:.2f} | {t / time1:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--kv", type=int, default=8, help="KV heads (8: MHA, 2: GQA)")
    ap.add_argument("--cp", default="1,2,4")
    ap.add_argument("--budget-mib", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    budget = args.budget_mib * 2**20
    results = {}
    for cp in (int(c) for c in args.cp.split(",")):
        print(f"cp={cp} ...", file=sys.stderr, flush=True)
        results[cp] = launch(_rank, cp, args.kv, args.seq, args.reps, budget, timeout=3600)
    print(render(args.kv, args.seq, budget, results))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": MODEL, "kv": args.kv, "seq": args.seq,
                                               "loadavg_after": os.getloadavg(),
                                               "results": results}, indent=2))


if __name__ == "__main__":
    main()
