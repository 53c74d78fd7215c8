"""Mixture of experts: expert state per rank, bytes moved per MoE layer, training-step time.

A small random Mixtral (hidden 256, 4 layers, 8 experts of 512 features,
top-2, vocabulary 1024) on ``--world`` Gloo processes (2 or 4) of one thread
each, float32, transformers' default experts implementation. The variants,
timed in one run, interleaved (order rotated every round, a barrier before
every step, the slowest rank's time, median over rounds):

* ``one process``: the unwrapped model, run by rank 0 alone (the others wait);
* ``experts split inside``: ``DistributedModelWrapper(model)`` (``moe_tp_experts``);
* ``whole experts, all-reduce`` / ``whole experts, all-to-all``:
  ``expert_parallel=True`` with ``expert_dispatch="all_reduce"`` / ``"all_to_all"``;
* ``ep 2 x tp 2`` (``--world 4``): ``expert_parallel=2``;
* ``transformers DistributedConfig``: transformers' own tensor and expert
  parallelism, ``from_pretrained(..., distributed_config=DistributedConfig(
  tp_size=world, ep_size=world))`` (its experts whole per rank, DTensor
  attention), loaded from a copy of the same weights.

A step is forward + backward + AdamW on a 4 x 64 batch. The table also gives
each variant's expert parameters on rank 0 against ``1/(ep*tp)`` of the
experts' total, its expert state on rank 0 after a step (parameters,
gradients, AdamW's two moments; the share of the memory that splitting
experts is for) against the same share, the bytes of collectives one MoE
layer issues per forward (torchtp's counters; transformers' DTensor
collectives are not counted) and per forward in all, and the largest logit
difference to the one-process model, and the per-layer cost of the check
that every rank routes every token alike, timed alone.

    .venv/bin/python benchmarks/moe.py [--rounds 9] [--world 2|4]
"""

from __future__ import annotations

import argparse
import os
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
from torchtp.cli._launch import launch

CONFIG = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
          "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
          "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 128}
HF = "transformers DistributedConfig"


def _build() -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(**CONFIG)).train()


def _expert_params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p for n, p in model.named_parameters() if ".experts." in n]


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    """The causal LM itself (a torchtp wrapper's ``base_model``; HF's own is its decoder)."""
    import torchtp

    return model.base_model if isinstance(model, torchtp.DistributedModelWrapper) else model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # transformers' DTensors


def _models(world: int, saved: str) -> dict[str, torch.nn.Module]:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import torchtp

    def wrap(**kw: Any) -> torch.nn.Module:
        return torchtp.DistributedModelWrapper(_build(), **kw)

    models = {"one process": _build(), "experts split inside": wrap(),
              "whole experts, all-reduce": wrap(expert_parallel=True,
                                                expert_dispatch="all_reduce"),
              "whole experts, all-to-all": wrap(expert_parallel=True,
                                                expert_dispatch="all_to_all")}
    if world == 4:
        models["ep 2 x tp 2"] = wrap(expert_parallel=2)
    models[HF] = AutoModelForCausalLM.from_pretrained(
        saved, distributed_config=DistributedConfig(tp_size=world, ep_size=world)).train()
    return models


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _rank(rank: int, world: int, rounds: int, saved: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.setdefault("LOCAL_RANK", str(rank))  # transformers' distributed loading reads it
    models = _models(world, saved)
    ids = torch.randint(0, CONFIG["vocab_size"], (4, 64), generator=torch.Generator().manual_seed(1))
    total = sum(p.numel() for p in _expert_params(models["one process"]))
    info: dict[str, Any] = {"total": total}
    with torch.no_grad():
        want = models["one process"](input_ids=ids).logits
        for name, m in models.items():
            layer, every, got = _bytes(m, ids)
            info[name] = {"experts": sum(_local(p).numel()
                                         for p in _expert_params(_inner(m))),
                          "layer bytes": layer, "bytes": every,
                          "err": float((_local(got) - want).abs().max())}
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
    for name, m in models.items():  # parameters, gradients and AdamW moments of the experts
        held = _expert_params(_inner(m))
        state = [t for p in held for t in opts[name].state[p].values() if t.dim()]
        # Parameters, AdamW's moments, and the gradients (zeroed: as large as the parameters).
        info[name]["state"] = sum(_local(t).numel() for t in [*held, *state, *held])
    info["times"] = times
    return info


def _bytes(model: torch.nn.Module, ids: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """Collective bytes of layer 0's experts module and of the whole forward; the logits."""
    import torchtp

    experts = _inner(model).model.layers[0].mlp.experts
    marks: list[int] = []
    with torchtp.count_collectives() as c:
        hooks = [experts.register_forward_pre_hook(lambda *_: marks.append(len(c.records))),
                 experts.register_forward_hook(lambda *_: marks.append(len(c.records)))]
        try:
            logits = model(input_ids=ids).logits
        finally:
            for h in hooks:
                h.remove()
    layer = c.records[marks[0]:marks[1]]
    size = sum(torch.Size(r.shape).numel() * torch.empty((), dtype=r.dtype).element_size()
               for r in layer)
    return size, c.bytes_moved(), logits


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
    lines = [f"{len(per_rank)} ranks; load average before -> after: {load[0]:.1f} -> "
             f"{load[1]:.1f}", "",
             "| variant | step ms | x one process | expert params on rank 0 | x (total / ranks) "
             "| expert state x share | bytes per MoE layer | bytes per forward | max logit diff |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, ms in med.items():
        row = info[name]
        layer, every = _counted(name, row["layer bytes"]), _counted(name, row["bytes"])
        lines.append(
            f"| {name} | {ms:.1f} | {ms / med['one process']:.2f} | {row['experts']:,} "
            f"| {row['experts'] / share:.2f} | {row['state'] / (4 * share):.2f} | {layer} "
            f"| {every} | {row['err']:.1e} |")
    forward_us = med["experts split inside"] * 1e3 / 3  # a step is ~3 forwards' work
    us = info["route check us"]
    lines += ["", f"route check (hash of every token's routes, riding the MoE all-reduce): "
              f"{us:.1f} us per MoE layer, {CONFIG['num_hidden_layers']} layers = "
              f"{100 * us * CONFIG['num_hidden_layers'] / forward_us:.2f}% of a forward (about "
              "a third of a step)"]
    return "\n".join(lines)


def _counted(name: str, value: int) -> str:
    """A byte count as the table shows it: transformers' DTensor collectives are not counted."""
    return "0" if name == "one process" else "n/a" if name == HF else f"{value:,}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--world", type=int, default=2, choices=(2, 4))
    args = parser.parse_args()
    before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="torchtp-moe-") as saved:
        _build().save_pretrained(saved)  # for transformers' own distributed loading
        per_rank = launch(_rank, args.world, args.rounds, saved)
    print(_table(per_rank, (before, os.getloadavg()[0])))


if __name__ == "__main__":
    main()
