"""Count the torchtp files (and functions) a real wrap and forward enter.

Issue 36's measure of how far a wrap travels through the package: functions
entered (``sys.setprofile``) in files under ``src/distributed/``, module-level
import code not counted, on rank 0 of a real tensor-parallel job: two
torchrun-style processes on Gloo, each wrapping the same model. Three moments:
``wrap`` (one ``DistributedModelWrapper(model)`` plus its first forward),
``plan`` (the same with an explicit plan) and ``steady`` (a later forward, after
three warm-up forwards). ``calls`` counts every Python call of a steady forward
(``cProfile``), torchtp's and torch's, beside a hand-written tensor-parallel
forward of the same model (the floor: the same layers' math and all-reduces
with ``torch.distributed`` directly).

    python benchmarks/wrap_files.py            # MLP and tiny HF Llama at world size 2
    python benchmarks/wrap_files.py --list     # also the files
    python benchmarks/wrap_files.py --world-size 1
"""

from __future__ import annotations

import argparse
import cProfile
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


def _floor_mlp(model: nn.Module, group: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP's forward by hand: the first Linear's rows and the second's columns, one
    all-reduce, the third whole."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    w1 = model[0].weight.chunk(world)[rank]
    b1 = model[0].bias.chunk(world)[rank]
    w2 = model[2].weight.chunk(world, 1)[rank]

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(nn.functional.linear(x, w1, b1))
        y = nn.functional.linear(h, w2)
        dist.all_reduce(y, group=group)
        return model[4](torch.relu(y + model[2].bias))
    return forward


def measure(world_size: int) -> dict[str, dict[str, Any]]:
    """On this rank: files and functions entered per case and moment, calls per forward."""
    out: dict[str, dict[str, Any]] = {}
    for name, (build, inputs, plan) in CASES.items():
        kwargs = inputs()
        holder: dict[str, Any] = {}

        def wrap_and_forward(explicit: dict[str, str] | None = None) -> None:
            holder["model"] = torchtp.DistributedModelWrapper(build(), plan=explicit)
            with torch.no_grad():
                holder["model"](**kwargs)

        wrap = entered(wrap_and_forward)
        planned = entered(lambda p=plan: wrap_and_forward(p))
        model = holder["model"]
        with torch.no_grad():
            for _ in range(3):
                model(**kwargs)
            steady = entered(lambda: model(**kwargs))
            profiler = cProfile.Profile()
            profiler.runcall(lambda: model(**kwargs))
        calls = pstats.Stats(profiler).total_calls  # type: ignore[attr-defined]
        out[name] = {"wrap": wrap, "plan": planned, "steady": steady, "calls": calls}
        if name == "mlp" and world_size > 1:
            floor = _floor_mlp(build(), dist.group.WORLD)
            with torch.no_grad():
                floor(kwargs["input"])
                profiler = cProfile.Profile()
                profiler.runcall(lambda: floor(kwargs["input"]))
            out[name]["floor calls"] = pstats.Stats(profiler).total_calls  # type: ignore[attr-defined]
    return out


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
