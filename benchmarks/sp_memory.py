"""Activation memory and step time per rank: sequence parallelism and loss parallelism.

One training step (forward with ``labels=``, backward, SGD) of a Llama (or,
``--moe``, a Qwen3-MoE: its MoE blocks run on the whole sequence under
sequence parallelism) at tp 1, 2 and 4 on Gloo CPU processes (one thread each), for:

* ``baseline``: torchtp with the HF plan (LM head gathered, HF's loss);
* ``sp``: ``sequence_parallel=True``; ``lp``: ``loss_parallel=True``; ``sp+lp``: both;
* ``dtensor``: PyTorch DTensor ``SequenceParallel`` + ``loss_parallel`` (tp > 1; Llama only).

Memory is the bytes autograd saves for the backward (unique storages, not
parameters, measured with ``saved_tensors_hooks``) plus the logits: the
activation + logits memory a step holds at its peak, deterministic on any
machine. Time is the median over interleaved repetitions of the slowest
rank's step (barrier before each). Prints a markdown table; ratios are from
the same run.

    .venv/bin/python benchmarks/sp_memory.py            # reduced model (see --help)
    .venv/bin/python benchmarks/sp_memory.py --full     # hidden 1024, 8 layers, seq 1024
    .venv/bin/python benchmarks/sp_memory.py --moe      # Qwen3-MoE, 8 experts, top 2
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _llama import HF_PLAN
from torchtp.cli._launch import launch

FULL = {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
        "num_key_value_heads": 16, "intermediate_size": 2816, "vocab_size": 32000}
REDUCED = {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
           "num_key_value_heads": 8, "intermediate_size": 1408, "vocab_size": 32000}
# The reduced Llama's attention with 8 experts of a quarter of its MLP each, top 2.
MOE = {**REDUCED, "head_dim": 64, "moe_intermediate_size": 352, "num_experts": 8,
       "num_experts_per_tok": 2}
VARIANTS = {"baseline": (False, False), "sp": (True, False), "lp": (False, True),
            "sp+lp": (True, True)}


def _build(cfg: dict[str, Any], seq: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    moe = "num_experts" in cfg
    config = (Qwen3MoeConfig if moe else LlamaConfig)(**cfg, max_position_embeddings=seq)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return (Qwen3MoeForCausalLM if moe else LlamaForCausalLM)(config).train()


def _dtensor(cfg: dict[str, Any], seq: int, world: int) -> torch.nn.Module:
    """PyTorch's recipe: SequenceParallel norms, PrepareModuleInput, lm_head for loss_parallel."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,))
    model = _build(cfg, seq)
    plan: dict[str, Any] = {
        # Replicated embedding output; the first norm's pre-hook cuts it (below).
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        plan.update({
            f"{p}.input_layernorm": SequenceParallel(),
            f"{p}.post_attention_layernorm": SequenceParallel(),
            f"{p}.self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            f"{p}.mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                           desired_input_layouts=(Replicate(),)),
            f"{p}.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            f"{p}.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{p}.{name}"] = ColwiseParallel()
    parallelize_module(model, mesh, plan)

    def cut(_mod: Any, args: tuple) -> tuple:  # replicated (B, T, d) -> this rank's (B, T/tp, d)
        x = args[0]
        n = x.shape[1] // world
        return (x[:, dist.get_rank() * n:(dist.get_rank() + 1) * n], *args[1:])

    model.model.layers[0].register_forward_pre_hook(cut)
    return model


def _variant(name: str, cfg: dict[str, Any], seq: int, world: int) -> torch.nn.Module:
    if name == "dtensor":
        return _dtensor(cfg, seq, world)
    import torchtp

    sp, lp = VARIANTS[name]
    # The MoE: its own HF plan (experts' features split), the LM head gathered too.
    plan = {**HF_PLAN, "lm_head": "colwise_gather_output"} if "num_experts" not in cfg \
        else None
    return torchtp.DistributedModelWrapper(_build(cfg, seq), plan=plan, sequence_parallel=sp,
                                           loss_parallel=lp)


def _loss(name: str, model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
    if name != "dtensor":
        out = model(ids, labels=ids)
        return out.loss, out.logits
    from torch.distributed.tensor.parallel import loss_parallel

    # Positions passed explicitly: HF would derive them from the embedding's length.
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    logits = model(ids, position_ids=positions).logits  # DTensor, vocab-split
    labels = F.pad(ids, (0, 1), value=-100)[:, 1:]
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    return loss, logits


def _backward(name: str, loss: torch.Tensor) -> None:
    if name != "dtensor":
        loss.backward()
        return
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():  # DTensor needs it around the backward too
        loss.backward()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (plain tensors as they are), outside autograd."""
    with torch.no_grad():
        return t.to_local() if hasattr(t, "to_local") else t


def _measure(name: str, model: torch.nn.Module, ids: torch.Tensor) -> tuple[int, float]:
    """Saved-activation + logits bytes of one step, and the loss."""
    params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = _local(t)
        try:
            ptr = local.untyped_storage().data_ptr()
        except RuntimeError:  # a storage-less wrapper: count its logical size
            ptr = -len(saved) - 1
        if ptr not in params:
            saved[ptr] = local.numel() * local.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, logits = _loss(name, model, ids)
    local = _local(logits)
    saved.setdefault(local.untyped_storage().data_ptr(), local.untyped_storage().nbytes())
    value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    _backward(name, loss)
    model.zero_grad(set_to_none=True)
    return sum(saved.values()), float(value.detach())


def _rank(rank: int, world: int, cfg: dict[str, Any], seq: int, reps: int) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    ids = torch.randint(0, cfg["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1))
    names = list(VARIANTS) + (["dtensor"] if world > 1 and "num_experts" not in cfg else [])
    models, memory, losses, failures = {}, {}, {}, {}
    for name in names:
        try:
            models[name] = _variant(name, cfg, seq, world)
            memory[name], losses[name] = _measure(name, models[name], ids)
        except Exception as err:  # report a variant's failure instead of aborting the run
            failures[name] = f"{type(err).__name__}: {err}"
            models.pop(name, None)
    opts = {n: torch.optim.SGD(m.parameters(), lr=1e-4) for n, m in models.items()}

    def step(name: str) -> float:
        dist.barrier() if world > 1 else None
        start = time.perf_counter()
        loss, _ = _loss(name, models[name], ids)
        _backward(name, loss)
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
        return time.perf_counter() - start

    times: dict[str, list[float]] = {n: [] for n in models}
    order = list(models)
    for rep in range(reps):
        for name in order[rep % len(order):] + order[:rep % len(order)]:
            times[name].append(step(name))
    return {"memory": memory, "loss": losses, "times": times, "failures": failures}


def summarize(world: int, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    first = per_rank[0]
    rows = {}
    for name in first["memory"]:
        slowest = [max(ts) for ts in zip(*(r["times"][name] for r in per_rank), strict=True)]
        rows[name] = {"memory_mib": max(r["memory"][name] for r in per_rank) / 2**20,
                      "step_ms": statistics.median(slowest) * 1e3, "loss": first["loss"][name]}
    return {"tp": world, "variants": rows, "failures": first["failures"]}


def render(results: list[dict[str, Any]]) -> str:
    tp1 = results[0]["variants"]["baseline"]["memory_mib"]
    lines = ["| tp | variant | act+logits MiB/rank | x (tp1 / tp) | step ms | x baseline | loss |",
             "|---|---|---|---|---|---|---|"]
    for res in results:
        base = res["variants"]["baseline"]["step_ms"]
        for name, r in res["variants"].items():
            ideal = tp1 / res["tp"]
            lines.append(f"| {res['tp']} | {name} | {r['memory_mib']:.1f} | "
                         f"{r['memory_mib'] / ideal:.2f} | {r['step_ms']:.0f} | "
                         f"{r['step_ms'] / base:.2f} | {r['loss']:.6f} |")
        for name, why in res["failures"].items():
            lines.append(f"| {res['tp']} | {name} | failed: {why[:150]} | | | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true",
                        help="the issue's model: hidden 1024, 8 layers, vocab 32000, seq 1024 "
                             "(default: hidden 512, 4 layers, vocab 32000, seq 512)")
    parser.add_argument("--moe", action="store_true",
                        help="a Qwen3-MoE with the reduced model's sizes, 8 experts, top 2")
    parser.add_argument("--seq", type=int, help="sequence length (default 512, 1024 with --full)")
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions")
    parser.add_argument("--tp", default="1,2,4")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    cfg = MOE if args.moe else FULL if args.full else REDUCED
    seq = args.seq or (1024 if args.full else 512)
    results = []
    for tp in (int(x) for x in args.tp.split(",")):
        print(f"tp={tp}: {args.reps} repetitions ...", file=sys.stderr, flush=True)
        results.append(summarize(tp, launch(_rank, tp, cfg, seq, args.reps, timeout=3600)))
    print(f"model: {cfg}, batch 1 x {seq} tokens, fp32, Gloo, 1 thread per rank")
    print(render(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": cfg, "seq": seq, "reps": args.reps,
                                               "loadavg_after": os.getloadavg(),
                                               "results": results}, indent=2))


if __name__ == "__main__":
    main()
