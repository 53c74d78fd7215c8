"""Hand-written models at tp 2: torchtp's plan vs the hand-written plan (and gather-everything).

Two parts, in the same processes:

1. **Collectives and bytes** (issue 24), for a torchtitan-shaped Llama, a
   timm-style ViT (Linear patch projection 48 -> 64, two blocks, a 10-class
   head), a 2-layer Phi-3 and a 2-layer Falcon (new decoder architecture, head
   untied): torchtp's choice (``plan=None``, chosen by cost) against the plan a
   user would write, collectives and the bytes handed to them per forward and
   per backward of one training step. torchtp's must be <= on every model
   (checked; the run fails otherwise).
2. **Time**, for the Llama: ``auto`` (``plan=None``), ``hand-written`` (the
   Megatron plan, ``TITAN_PLAN``) and ``gather-everything`` (every Linear
   split on out_features and all-gathered, what the automatic plan did for
   hand-written models before dataflow pairing), timed interleaved in the
   same processes: forward (``torch.no_grad``) and training step (forward,
   backward, SGD), median milliseconds over interleaved repetitions on the
   slowest rank, ratios to the hand-written plan from the same run.

    .venv/bin/python benchmarks/handwritten_plans.py [--tp 2] [--dim 512] [--reps 15]
    .venv/bin/python benchmarks/handwritten_plans.py --counts-only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _handwritten import TITAN_PLAN, VOCAB, TitanLlama
from tests.distributed import _cost_checks

import torchtp
from torchtp.cli._launch import launch

GATHER_ALL = {"layers.*.attention.w?": "colwise_gather_output",
              "layers.*.feed_forward.w?": "colwise_gather_output",
              "output": "colwise_gather_output"}
PLANS: dict[str, Any] = {"auto": None, "hand-written": TITAN_PLAN, "gather-everything": GATHER_ALL}


def _rank(rank: int, world: int, dim: int, layers: int, tokens: int, reps: int) -> dict[str, Any]:
    models, optims, counts = {}, {}, {}
    for name, plan in PLANS.items():
        models[name] = torchtp.DistributedModelWrapper(_titan(dim, layers, tokens), plan=plan)
        optims[name] = torch.optim.SGD(models[name].parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (2, tokens + 1), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def forward(name: str) -> None:
        with torch.no_grad():
            models[name](x)

    def train_step(name: str) -> None:
        optims[name].zero_grad()
        F.cross_entropy(models[name](x).flatten(0, 1), y.flatten()).backward()
        optims[name].step()

    for name in PLANS:
        with torchtp.count_collectives() as fwd:
            forward(name)
        counts[name] = dict(fwd.counts)
        train_step(name)  # warm-up
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(reps):
        for mode, fn in (("forward", forward), ("train step", train_step)):
            for name in PLANS:
                dist.barrier()
                start = time.perf_counter()
                fn(name)
                times.setdefault((mode, name), []).append((time.perf_counter() - start) * 1e3)
    return {"counts": counts, "ms": {f"{m}|{n}": statistics.median(v)
                                     for (m, n), v in times.items()}}


def _titan(dim: int, layers: int, tokens: int) -> TitanLlama:
    torch.manual_seed(0)
    return TitanLlama(dim=dim, n_layers=layers, n_heads=8, n_kv_heads=4,
                      hidden_dim=dim * 11 // 4, max_seq_len=tokens)


def _traffic(counter: Any) -> dict[str, int]:
    out: dict[str, int] = dict(counter.counts)
    out["bytes"] = sum(torch.Size(r.shape).numel() * r.dtype.itemsize for r in counter.records)
    return out


def _counts_rank(rank: int, world: int, dim: int, layers: int, tokens: int) -> dict[str, Any]:
    """Per model and plan: collectives and bytes per forward and per backward of one step."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    ids = torch.randint(0, VOCAB, (2, tokens + 1), generator=torch.Generator().manual_seed(1))
    for name, plan in (("torchtp", None), ("hand-written", TITAN_PLAN)):
        model = torchtp.DistributedModelWrapper(_titan(dim, layers, tokens), plan=plan)
        with torchtp.count_collectives() as fwd:
            logits = model(ids[:, :-1])
        with torchtp.count_collectives() as bwd:
            F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        out[f"llama|{name}"] = (_traffic(fwd), _traffic(bwd), model.resolved_plan.source)
    for kind in _cost_checks.MODELS:
        data = _cost_checks.batch(kind)
        for name, plan in (("torchtp", None), ("hand-written", _cost_checks.HAND[kind])):
            model = _cost_checks.wrap(kind, plan)
            with torchtp.count_collectives() as fwd:
                loss = _cost_checks.loss_of(kind, model, data)
            with torchtp.count_collectives() as bwd:
                loss.backward()
            out[f"{kind}|{name}"] = (_traffic(fwd), _traffic(bwd), model.resolved_plan.source)
    return out


def _ops(traffic: dict[str, int]) -> str:
    return ", ".join(f"{n} {op}" for op, n in sorted(traffic.items()) if op != "bytes") or "none"


def _print_counts(counts: dict[str, Any], tp: int, dim: int) -> bool:
    """The table; whether torchtp's choice is <= the hand-written plan on every model."""
    print(f"collectives per forward and per backward of one training step, tp={tp} (rank 0); "
          f"bytes: the tensors handed to the collectives (Llama: dim {dim})")
    print("| model | plan | source | forward | bytes | backward | bytes |")
    print("|---|---|---|---|---|---|---|")
    ok = True
    for model in ("llama", *_cost_checks.MODELS):
        mine, hand = counts[f"{model}|torchtp"], counts[f"{model}|hand-written"]
        for name in ("torchtp", "hand-written"):
            fwd, bwd, source = counts[f"{model}|{name}"]
            print(f"| {model} | {name} | {source} | {_ops(fwd)} | {fwd['bytes']} | {_ops(bwd)} "
                  f"| {bwd['bytes']} |")
        for part in (0, 1):  # forward, backward: every op and the bytes
            ok &= all(n <= hand[part].get(op, 0) for op, n in mine[part].items())
    print("torchtp <= hand-written on every model (calls per op and bytes, forward and "
          f"backward): {'yes' if ok else 'NO'}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128, help="sequence length (batch 2)")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--counts-only", action="store_true",
                        help="only the collectives and bytes (no timing)")
    args = parser.parse_args()
    counts = launch(_counts_rank, args.tp, args.dim, args.layers, args.tokens)[0]
    ok = _print_counts(counts, args.tp, args.dim)
    if args.counts_only:
        sys.exit(0 if ok else 1)
    print()
    results = launch(_rank, args.tp, args.dim, args.layers, args.tokens, args.reps)
    print(f"torchtitan-shaped Llama, dim {args.dim}, {args.layers} layers, 8 heads / 4 KV heads, "
          f"batch 2 x {args.tokens} tokens, tp={args.tp}: median ms (slowest rank)")
    print("| plan | collectives per forward | forward ms | vs hand | train step ms | vs hand |")
    print("|---|---|---|---|---|---|")
    slowest = {k: max(r["ms"][k] for r in results) for k in results[0]["ms"]}
    for name in PLANS:
        ops = ", ".join(f"{n} {op}" for op, n in sorted(results[0]["counts"][name].items()))
        fwd, step = slowest[f"forward|{name}"], slowest[f"train step|{name}"]
        print(f"| {name} | {ops} | {fwd:.2f} | {fwd / slowest['forward|hand-written']:.2f}x | "
              f"{step:.2f} | {step / slowest['train step|hand-written']:.2f}x |")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
