"""Count the torchtp files (and functions) a real wrap and forward enter.

Issue 36's measure of how far a wrap travels through the package: functions
entered (``sys.setprofile``) in files under ``src/distributed/``, module-level
import code not counted, on rank 0 of a real tensor-parallel job: two
torchrun-style processes on Gloo, each wrapping the same model. Three moments:
``wrap`` (one ``DistributedModelWrapper(model)`` plus its first forward),
``plan`` (the same with an explicit plan) and ``steady`` (a later forward, after
three warm-up forwards). ``calls`` counts every call of a steady forward
(``cProfile``: Python functions and builtins, torchtp's, torch's and the
model's), beside a hand-written tensor-parallel forward of the same model with
the explicit plan (the floor: weights sliced in place, one
``torch.distributed.all_reduce`` per weight-column split, as
benchmarks/_variants.py builds it).

    python benchmarks/wrap_files.py            # MLP and tiny HF Llama at world size 2
    python benchmarks/wrap_files.py --list     # also the files
    python benchmarks/wrap_files.py --world-size 1
"""

from __future__ import annotations

import argparse
import cProfile
import fnmatch
import json
import os
import pstats
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import torchtp

ROOT = str(Path(torchtp.__file__).resolve().parent)
MLP_PLAN = {"0": "colwise", "2": "rowwise", "4": "replicate"}
LLAMA_PLAN = {"model.layers.*.self_attn.q_proj": "colwise",
              "model.layers.*.self_attn.k_proj": "colwise",
              "model.layers.*.self_attn.v_proj": "colwise",
              "model.layers.*.self_attn.o_proj": "rowwise",
              "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
              "model.layers.*.mlp.down_proj": "rowwise"}


def entered(run: Callable[[], Any]) -> dict[str, set[str]]:
    """Files under the package whose functions ``run`` entered, with those functions."""
    seen: dict[str, set[str]] = {}

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        path = os.path.realpath(code.co_filename)
        if path.startswith(ROOT) and code.co_name != "<module>":
            seen.setdefault(os.path.relpath(path, ROOT), set()).add(code.co_qualname)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(),
                         nn.Linear(16, 8))


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg).eval()


def _seeded() -> torch.Generator:
    return torch.Generator().manual_seed(1)  # the same batch on every rank


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], dict[str, Any]], dict[str, str]]] = {
    "mlp": (_mlp, lambda: {"input": torch.randn(2, 16, generator=_seeded())}, MLP_PLAN),
    "hf-llama": (_llama, lambda: {"input_ids": torch.randint(0, 64, (2, 8), generator=_seeded())},
                 LLAMA_PLAN),
}


class _FloorRowwise(nn.Module):
    """A hand-written weight-column split: the local matmul, one ``dist.all_reduce``."""

    def __init__(self, linear: nn.Linear, group: Any) -> None:
        super().__init__()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group = group
        self.weight = nn.Parameter(linear.weight.detach().chunk(world, 1)[rank].contiguous())
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x, self.weight)  # (..., out), this rank's partial sum
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


def _floor(model: nn.Module, plan: dict[str, str], group: Any) -> nn.Module:
    """The model by hand, as benchmarks/_variants.py's floor: ``colwise`` Linears' rows
    sliced in place, ``rowwise`` ones replaced by :class:`_FloorRowwise`."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    for name, mod in list(model.named_modules()):
        style = next((v for k, v in plan.items() if fnmatch.fnmatchcase(name, k)), None)
        if style == "colwise":
            mod.weight = nn.Parameter(mod.weight.detach().chunk(world)[rank].contiguous())
            if mod.bias is not None:
                mod.bias = nn.Parameter(mod.bias.detach().chunk(world)[rank].contiguous())
        elif style == "rowwise":
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, _FloorRowwise(mod, group))
    return model


def _calls(run: Callable[[], Any]) -> int:
    """Calls ``run`` makes (cProfile: Python functions and builtins)."""
    profiler = cProfile.Profile()
    profiler.runcall(run)
    return int(pstats.Stats(profiler).total_calls)  # type: ignore[attr-defined]


def _case(build: Callable[[], nn.Module], kwargs: dict[str, Any], plan: dict[str, str],
          world_size: int) -> dict[str, Any]:
    """One model's files and functions per moment, and calls per steady forward."""
    holder: dict[str, Any] = {}

    def wrap_and_forward(explicit: dict[str, str] | None = None) -> None:
        holder["model"] = torchtp.DistributedModelWrapper(build(), plan=explicit)
        with torch.no_grad():
            holder["model"](**kwargs)

    out: dict[str, Any] = {"wrap": entered(wrap_and_forward),
                           "plan": entered(lambda: wrap_and_forward(plan))}
    model = holder["model"]
    with torch.no_grad():
        for _ in range(3):
            model(**kwargs)
        out["steady"] = entered(lambda: model(**kwargs))
        out["calls"] = _calls(lambda: model(**kwargs))
        if world_size > 1:
            floor = _floor(build(), plan, dist.group.WORLD)
            floor(**kwargs)
            out["floor calls"] = _calls(lambda: floor(**kwargs))
    return out


def measure(world_size: int) -> dict[str, dict[str, Any]]:
    """On this rank: files and functions entered per case and moment, calls per forward."""
    return {name: _case(build, inputs(), plan, world_size)
            for name, (build, inputs, plan) in CASES.items()}


def _rank_main() -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        torchtp.init_tensor_parallel()
    result = measure(world)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({c: {k: ({f: sorted(fns) for f, fns in v.items()}
                                  if isinstance(v, dict) else v) for k, v in r.items()}
                              for c, r in result.items()}))


def launch(world_size: int) -> dict[str, dict[str, Any]]:
    """Run :func:`measure` on ``world_size`` torchrun-style processes; rank 0's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--rank-process"], stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world_size),
                 LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), OMP_NUM_THREADS="1"))
        for r in range(world_size)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a rank failed: exit codes {[p.returncode for p in procs]}")
    return dict(json.loads(outs[0].strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--list", action="store_true", help="also list the files")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rank-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_process:
        _rank_main()
        return
    results = launch(args.world_size)
    print(f"world size {args.world_size}, rank 0")
    print(f"{'case':<10} {'wrap':>5} {'plan':>5} {'steady':>6} {'calls':>6} {'floor':>6}")
    for name, r in results.items():
        print(f"{name:<10} {len(r['wrap']):>5} {len(r['plan']):>5} {len(r['steady']):>6} "
              f"{r['calls']:>6} {r.get('floor calls', '-'):>6}")
        if args.list:
            for moment in ("wrap", "plan", "steady"):
                print(f"  {moment}:")
                for f, fns in sorted(r[moment].items()):
                    print(f"    {f}: {', '.join(fns)}")


if __name__ == "__main__":
    main()
