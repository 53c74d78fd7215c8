"""Mixture of experts at tp 2: expert parameters per rank, bytes moved, training-step time.

A small random Mixtral (hidden 256, 4 layers, 8 experts of 512 features,
top-2, vocabulary 1024) on two Gloo processes of one thread each, float32,
transformers' default experts implementation. Three variants, timed in one
run, interleaved (order rotated every round, a barrier before every step, the
slowest rank's time, median over rounds):

* ``one process``: the unwrapped model, run by rank 0 alone (rank 1 waits);
* ``experts split inside``: ``DistributedModelWrapper(model)`` (``moe_tp_experts``);
* ``whole experts``: ``DistributedModelWrapper(model, expert_parallel=True)``.

A step is forward + backward + AdamW on a 4 x 64 batch. The table also gives
each variant's expert parameters on one rank (against ``1/tp`` of the
experts' total), its bytes of collectives per forward and the largest
logit difference to the one-process model, and the per-layer cost of the
check that every rank routes every token alike, timed alone.

    .venv/bin/python benchmarks/moe.py [--rounds 9]
"""

from __future__ import annotations

import argparse
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
from torchtp.cli._launch import launch

CONFIG = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
          "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
          "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 128}


def _build() -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(**CONFIG)).train()


def _expert_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)


def _models() -> dict[str, torch.nn.Module]:
    import torchtp

    return {"one process": _build(),
            "experts split inside": torchtp.DistributedModelWrapper(_build()),
            "whole experts": torchtp.DistributedModelWrapper(_build(), expert_parallel=True)}


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _rank(rank: int, world: int, rounds: int) -> dict[str, Any]:
    import torchtp

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    models = _models()
    ids = torch.randint(0, CONFIG["vocab_size"], (4, 64), generator=torch.Generator().manual_seed(1))
    total = _expert_params(models["one process"])
    info: dict[str, Any] = {"total": total}
    with torch.no_grad():
        want = models["one process"](input_ids=ids).logits
        for name, m in models.items():
            with torchtp.count_collectives() as c:
                got = m(input_ids=ids).logits
            info[name] = {"experts": _expert_params(getattr(m, "base_model", m)),
                          "bytes": c.bytes_moved(), "err": float((got - want).abs().max())}
    info["route check us"] = _route_check_alone(models["experts split inside"], ids.numel())
    # The timed steps move the weights; the checks above are done by then.
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-4) for n, m in models.items()}
    times: dict[str, list[float]] = {n: [] for n in models}
    names = list(models)
    for r in range(rounds + 1):  # round 0 warms up
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            if name != "one process" or rank == 0:
                _step(models[name], opts[name], ids)
            if r:
                times[name].append(time.perf_counter() - start)
    info["times"] = times
    return info


def _route_check_alone(wrapped: torch.nn.Module, tokens: int, calls: int = 2000) -> float:
    """Microseconds per MoE layer of the route check's own work (hash the routes, ride)."""
    from torchtp.comm import ops

    experts = wrapped.base_model.model.layers[0].mlp.experts
    routes = torch.randint(0, CONFIG["num_local_experts"], (tokens, CONFIG["num_experts_per_tok"]))
    start = time.perf_counter()
    for _ in range(calls):
        ops.cancel_ride(experts.tp_group, experts._ride_routes(routes))
    return (time.perf_counter() - start) / calls * 1e6


def _table(per_rank: list[dict[str, Any]], load: tuple[float, float]) -> str:
    info = per_rank[0]
    med = {n: statistics.median(max(ts) for ts in zip(*(r["times"][n] for r in per_rank),
                                                       strict=True)) * 1e3
           for n in info["times"]}
    share = info["total"] / len(per_rank)
    lines = [f"load average before -> after: {load[0]:.1f} -> {load[1]:.1f}", "",
             "| variant | step ms | x one process | expert params on rank 0 | x (total / tp) "
             "| collective bytes per forward | max logit diff |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, ms in med.items():
        row = info[name]
        lines.append(f"| {name} | {ms:.1f} | {ms / med['one process']:.2f} | {row['experts']:,} "
                     f"| {row['experts'] / share:.2f} | {row['bytes']:,} | {row['err']:.1e} |")
    forward_us = med["experts split inside"] * 1e3 / 3  # a step is ~3 forwards' work
    us = info["route check us"]
    lines += ["", f"route check (hash of every token's routes, riding the MoE all-reduce): "
              f"{us:.1f} us per MoE layer, {CONFIG['num_hidden_layers']} layers = "
              f"{100 * us * CONFIG['num_hidden_layers'] / forward_us:.2f}% of a forward (about "
              "a third of a step)"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    before = os.getloadavg()[0]
    per_rank = launch(_rank, 2, args.rounds)
    print(_table(per_rank, (before, os.getloadavg()[0])))


if __name__ == "__main__":
    main()
