"""The checks that run before any weight is cut, and the one verdict every rank reaches.

The wrapper's pipeline is resolve → agree → apply → hooks. Everything that must
hold before slicing lives here: the model is not already parallel, its
parameters sit where the group can communicate, and (at tp > 1) every rank
resolved the same plan from the same weights. :func:`agree` is the pipeline's
second step: a rank-local error, or a fingerprint that differs, raises on every
rank before any rank cuts a weight, so a bad input never leaves the others
waiting in a collective.

May import: runtime, layers, plans, the check helpers (agreement, devices,
fingerprints, rng); nothing that runs per call.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..comm.devices import device_mismatch
from ..layers import ColumnParallelLinear, RowParallelLinear, rng
from ..plans import ResolvedPlan, ShardContext
from .agreement import agree as agree_across
from .fingerprints import tensor_digest

WHO = "DistributedModelWrapper"


def refuse_wrapped(model: nn.Module, wrapper_type: type) -> None:
    """Raise when ``model`` is already a wrapper, a DDP, holds torchtp layers or
    sharded (DTensor) parameters.

    Raises:
        ValueError: naming what was found and the fix.
    """
    if isinstance(model, wrapper_type):
        raise ValueError("model is already a DistributedModelWrapper; wrap the original "
                         "model once (use wrapper.base_model to reach it)")
    if isinstance(model, DistributedDataParallel):
        raise ValueError("model is a DistributedDataParallel: wrap the model first, then build "
                         "DDP around the DistributedModelWrapper (see docs/training.md)")
    tp_size = _transformers_tp_size()
    for name, mod in model.named_modules():
        if isinstance(mod, (RowParallelLinear, ColumnParallelLinear)):
            raise ValueError(f"model is already tensor-parallel: '{name}' is a "
                             f"{type(mod).__name__}; wrap the original model once")
        size = tp_size(mod)
        if size > 1:
            raise ValueError(
                f"model is already sharded: {name or type(mod).__name__!r} was loaded with "
                f"transformers' own tensor parallelism (from_pretrained(..., tp_plan=...) over "
                f"{size} ranks), so each rank holds transformers' shards, while "
                "DistributedModelWrapper cuts the full weights itself: load it without tp_plan "
                "and wrap it, or load it with DistributedModelWrapper.from_pretrained(path), "
                "which reads only this rank's shard")
    _refuse_dtensors(model)


def _transformers_tp_size() -> Callable[[nn.Module], int]:
    """Over how many ranks transformers' own tensor parallelism split a module (1: not)."""
    if "transformers" not in sys.modules:  # no HF model without it; hf stays unloaded
        return lambda _module: 1
    from ..hf.compat import transformers_tp_size

    return transformers_tp_size


def _refuse_dtensors(model: nn.Module) -> None:
    """Raise when a parameter is a DTensor: the model was sharded before the wrap."""
    # Not imported means no DTensor exists (importing it costs ~1 s: layers.ddp_guard)
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is None:
        return
    for name, p in model.named_parameters():
        if isinstance(p, dtensor):
            raise ValueError(
                f"model is already sharded: parameter '{name}' is a DTensor "
                f"({', '.join(map(repr, p.placements))} over a mesh of {p.device_mesh.size()} "
                "ranks), as PyTorch's parallelize_module, FSDP2's fully_shard and transformers' "
                "from_pretrained(tp_plan=...) leave it, while DistributedModelWrapper cuts the "
                "full weights itself: wrap the unsharded model (from_pretrained without "
                "tp_plan), and apply fully_shard(module, mesh=cfg.mesh['dp']) after the wrap "
                "(docs/training.md)")


def before_slicing(model: nn.Module, plan: ResolvedPlan, ctx: ShardContext,
                   options: tuple[Any, ...], extra: dict[str, Any]) -> dict[str, Any]:
    """Check the model's devices and return what every rank must agree on.

    Args:
        model: The model, not yet sliced.
        plan: The resolved plan.
        ctx: Where the shards go.
        options: The wrapper's options that change what is cut or installed.
        extra: Further values the ranks must share, by description.

    Returns:
        The fingerprint for :func:`agree`: world size, plan, every planned
        layer's style and full shape, the options, and a sampled digest of every
        parameter and buffer (ranks built from different seeds or checkpoint
        copies would otherwise each keep a slice of a different model).

    Raises:
        ValueError: the parameters sit where the group's backend cannot communicate.
    """
    if ctx.world_size > 1:
        wrong_device = device_mismatch(model, ctx.group)
        if wrong_device is not None:
            raise wrong_device
    prints: dict[str, Any] = {"world_size": ctx.world_size, "plan": plan.rules,
                              "attention checks": plan.checks, "options": options, **extra}
    for name, layer in plan.layers.items():
        prints[f"layer '{name}'"] = (layer.style, layer.full)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        prints[f"weights of '{name}' (sampled digest; ranks built with different seeds or "
               "from different checkpoint copies?)"] = tensor_digest(t)
    return prints


def agree(error: BaseException | None, fingerprint: dict[str, Any],
          ctx: ShardContext | None, group: Any) -> None:
    """The pipeline's agree step: one verdict on every rank, then shared RNG streams.

    At tp 1 there is nobody to agree with: a local error raises as it is, and
    the model keeps drawing from the caller's generator.

    Raises:
        The first failing rank's error, or :class:`~torchtp.RankMismatchError`
        naming what differs, on every rank.
    """
    size = ctx.world_size if ctx is not None else None
    if group is not None and size != 1:
        agree_across(WHO, error, fingerprint, group)
    elif error is not None:
        raise error
    if size != 1:
        rng.sync(group)
