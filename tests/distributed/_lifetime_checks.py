"""Rank functions: nothing of torchtp's keeps a process group alive past its destruction.

``dist.destroy_process_group()`` drops torch's references to every group; a group
nobody else holds is freed right there (Gloo's worker threads joined while the
interpreter is whole). A group still held by a layer, a hook, an autograd node
of a kept output or torchtp's own state lives on until the interpreter shuts
down, where a Gloo worker freeing a finished collective's tensor aborts the
process ("terminate called without an active exception", issue 35). Each
scenario here starts a group, uses torchtp the way a user does, keeps what a
script keeps (the model, the optimizer, outputs with their graphs), destroys
the group and checks, *without* a garbage collection (the interpreter's last
collection is where the abort happened), that every group torchtp used is gone.
"""

from __future__ import annotations

import gc
import os
import types
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def _start(workdir: str, name: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store-{name}",
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timedelta(seconds=30))


def _label(holder: Any, held: Any) -> str:
    if isinstance(holder, dict):
        keys = [repr(k)[:40] for k, v in holder.items() if v is held][:2] or ["<as a key>"]
        return f"dict{keys}"
    if isinstance(holder, types.FunctionType):
        return f"function {holder.__qualname__}"
    return f"{type(holder).__module__}.{type(holder).__qualname__}"


def holders(obj: Any, depth: int = 4, seen: set[int] | None = None,
            indent: str = "") -> list[str]:
    """Who references ``obj``, as an indented chain of referrers (for the failure message)."""
    seen = set() if seen is None else seen
    out: list[str] = []
    if depth == 0:
        return out
    for ref in gc.get_referrers(obj):
        if id(ref) in seen or isinstance(ref, types.FrameType):
            continue
        seen.add(id(ref))
        out.append(indent + _label(ref, obj))
        if not isinstance(ref, types.ModuleType):
            out += holders(ref, depth - 1, seen, indent + "  ")
    return out


def _mlp(workdir: str) -> list[Any]:
    import torchtp

    torch.manual_seed(0)
    model = torchtp.DistributedModelWrapper(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)))
    x = torch.randn(4, 16)
    model.eval()
    with torch.no_grad():
        model(x)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).sum().backward()
    torchtp.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    kept = model(x)  # an output whose graph (autograd nodes) the script keeps
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, float(kept.sum()))  # the user's own collective
    return [model, opt, kept]


def _llama(workdir: str) -> list[Any]:
    """Sequence and loss parallel, AdamW, generate, a sharded save; 1 KV head at tp 2
    (replicated: its gradient is summed over a sub-group)."""
    import transformers

    import torchtp

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=1, max_position_embeddings=32)
    model = torchtp.DistributedModelWrapper(transformers.LlamaForCausalLM(config),
                                            sequence_parallel=True, loss_parallel=True)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    model.eval()
    generated = model.generate(ids[:, :4], max_new_tokens=3, do_sample=False)
    model.save_pretrained(f"{workdir}/llama")
    return [model, opt, loss, generated]


def _moe(workdir: str) -> list[Any]:
    import torchtp

    from ._moe_checks import _batch, build_moe
    from .test_moe import _sentinel

    # Whole experts where transformers has the expert-parallel sentinel (5.24), else split
    # inside (older releases refuse expert_parallel; test_moe pins that).
    model = torchtp.DistributedModelWrapper(build_moe("qwen3_moe").train(),
                                            expert_parallel=_sentinel())
    out = model(**_batch())
    out.loss.backward()
    return [model, out]


def _pipeline(workdir: str) -> list[Any]:
    import torchtp
    from torchtp.pipeline import PipelineSchedule, decoder_stage

    from ._pipeline_checks import batch, build_llama

    torchtp.init_parallel(pp=dist.get_world_size())
    stage = decoder_stage(build_llama(2), dist.get_rank(), dist.get_world_size())
    pipe = PipelineSchedule(stage, 2, "1f1b")
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    pipe.step(*batch(0))
    opt.step()
    return [stage, pipe, opt]


SCENARIOS: dict[str, Callable[[str], list[Any]]] = {
    "mlp": _mlp, "llama": _llama, "moe": _moe, "pipeline": _pipeline}


def check_groups_freed(rank: int, world_size: int, workdir: str,
                       names: list[str]) -> dict[str, list[str]]:
    """Run each scenario in a fresh group; after ``destroy_process_group()``, the groups
    torchtp used that are still alive, with who holds them (empty lists: all freed)."""
    from torchtp.comm import health

    alive: dict[str, list[str]] = {}
    for name in names:
        _start(workdir, name)
        kept = SCENARIOS[name](workdir)
        refs = [weakref.ref(dist.group.WORLD), *(st.ref for st in health._STATES.values())]
        dist.destroy_process_group()
        alive[name] = [f"group {i}:\n" + "\n".join(holders(ref()))
                       for i, ref in enumerate(refs) if ref() is not None]
        del kept
    return alive
