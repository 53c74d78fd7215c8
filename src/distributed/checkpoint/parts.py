"""What a collective checkpoint call was given: this rank's models and their TP groups.

The checkpoint functions take either the tensor-parallel wrapper (or a DDP
around it) or, in a pipeline job, this rank's pipeline stages: one stage or a
list of them (several stages per rank), each as it is or inside DDP or
``fully_shard``. Both are recognised by what they have, not by class (the
checkpoint layer sits below the wrapper and the pipeline): a wrapper has
``base_model`` and ``resolved_plan``; a stage has ``model``, ``stage``,
``stages`` and ``tied_weight``.

A stage's model keeps the unsplit model's parameter names, so a pipeline
job's checkpoint is the unsplit model's, written by the stages together: each
stage writes the names it holds. The one exception is a tied embedding: the
first stage's input embedding and the last stage's LM head are copies of one
weight (``Stage.tied``), which an unsplit model holds, and its checkpoints
store, once under the embedding's name. The last stage's copy is therefore
saved by the first stage and loaded from the embedding's name, which
:func:`agree_parts` fetches from the rank holding the first stage while the
ranks check that they are saving one job's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm.group_ref import WeakGroup
from ..comm.objects import all_gather_object
from ..comm.runtime import ProcessGroup
from ..layers.owned import split_group
from .placements import placements

_HYPER = "optimizer's param_groups (hyper-parameters)"


@dataclass
class Part:
    """One model of this rank, as a checkpoint sees it.

    Attributes:
        model: The module whose parameters are saved (the unsplit model's names).
        group: Its tensor-parallel group (``None``: not split).
        stage: Its pipeline stage, or ``None`` for a whole model.
        stages: How many stages the pipeline has (1 for a whole model).
        tied: This stage's copy of a tied embedding (first or last stage), if any.
        copy: ``tied`` is the last stage's copy: saved by the first stage
            under the embedding's name.
    """

    model: nn.Module
    group: WeakGroup[ProcessGroup | None] = WeakGroup(required=True)  # held weakly (comm.group_ref)
    stage: int | None = None
    stages: int = 1
    tied: torch.Tensor | None = None
    copy: bool = False


def is_stage(module: Any) -> bool:
    """``module`` is a pipeline stage (or a DDP around one)."""
    return all(hasattr(_inner(module), a) for a in ("model", "stage", "stages", "tied_weight"))


def _inner(module: Any) -> Any:
    """What a ``DistributedDataParallel`` wraps; anything else itself."""
    from torch.nn.parallel import DistributedDataParallel

    return module.module if isinstance(module, DistributedDataParallel) else module


def is_pipeline(model: Any) -> bool:
    """``model`` is a pipeline stage or a non-empty list of them."""
    if isinstance(model, Sequence) and not isinstance(model, nn.Module):
        return bool(model) and all(is_stage(m) for m in model)
    return is_stage(model)


def parts(model: Any, what: str) -> list[Part]:
    """This rank's models: the wrapper's base model, or each of its pipeline stages.

    Raises:
        TypeError: ``model`` is neither (its parameters have no torchtp layout
            and no stage says which part of the model it is).
    """
    if is_pipeline(model):
        return [_stage_part(m) for m in (model if isinstance(model, Sequence) else [model])]
    inner = _inner(model)
    base = getattr(inner, "base_model", None)
    if not (hasattr(inner, "resolved_plan") and isinstance(base, nn.Module)):
        raise TypeError(
            f"{what} needs the DistributedModelWrapper (or a DDP around it), got "
            f"{type(inner).__name__}: the checkpoint stores each parameter with its tensor-"
            "parallel layout (which dimension is split, and where), which only the wrapper "
            "knows; wrap the model first (torchtp.DistributedModelWrapper(model)) on every "
            "rank, or in a pipeline job pass this rank's stage(s) (decoder_stage, "
            "block_stage)")
    if any(getattr(m, "held_elsewhere", False) for m in base.modules()):
        # A stage's model: only the stage knows its tied copy, saved once by the first stage.
        raise TypeError(f"{what} was given the wrapper of a pipeline stage's model; pass the "
                        "stage itself (what decoder_stage or block_stage returned), on every "
                        "rank of every stage")
    return [Part(base, inner.group)]


def _stage_part(module: Any) -> Part:
    """A stage's model, the TP group its parallel layers are split over, its tied copy."""
    stage = _inner(module)
    tied = stage.tied_weight()
    return Part(stage.model, split_group(stage.modules()), stage.stage, stage.stages, tied,
                tied is not None and stage.stage == stage.stages - 1)


def _tied_name(part: Part) -> str | None:
    """The name of a first stage's tied embedding in its model (the unsplit model's name)."""
    if part.tied is None or part.copy:
        return None
    return next(n for n, p in part.model.named_parameters() if p is part.tied)


def agree_parts(given: list[Part], optimizer: torch.optim.Optimizer | None, step: int | None,
                what: str) -> str | None:
    """The tied embedding's checkpoint name, from the rank holding the first stage; raises
    on every rank unless every rank passes the same kind of model, optimizer settings and
    ``step`` (``None``: not compared).

    Collective over the world (one object gather): call it before DCP's own
    collectives, so a rank that would save or load something else raises
    everywhere instead of leaving the others in DCP's exchange.

    Raises:
        ValueError: on every rank, naming what differs (or this rank's clash).
    """
    names = [n for part in given if (n := _tied_name(part)) is not None]
    hyper = None if optimizer is None else repr(
        [{k: _plain(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups])
    mine: dict[str, Any] = {
        "kind": "pipeline stages" if given[0].stage is not None else "a wrapped model",
        _HYPER: hyper, "step": step, "copy": any(part.copy for part in given),
        "name": names[0] if names else None, "clash": _clash(given)}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        everyone = [mine]
    else:
        everyone = all_gather_object(mine, None, f"{what}'s agreement")
    for key in ("kind", _HYPER, "step"):
        seen = {repr(f[key]) for f in everyone}
        if len(seen) > 1:
            raise ValueError(
                f"{what} is one checkpoint of the whole job, but the ranks pass different "
                f"{key}: {sorted(seen)}; every rank (every pipeline stage) must pass the same "
                "(stages use one optimizer setup: the checkpoint stores one param_groups list)")
    clash = next((f"rank {r}: {f['clash']}" for r, f in enumerate(everyone) if f["clash"]), None)
    tied = next((f["name"] for f in everyone if f["name"] is not None), None)
    if clash is None and any(f["copy"] for f in everyone) and tied is None:
        clash = "a last stage holds a tied embedding copy, but no rank holds the first stage"
    if clash is not None:
        raise ValueError(f"{what}: {clash}")
    return tied


def _clash(given: list[Part]) -> str | None:
    """Why this rank's stages cannot share one checkpoint entry per name, or ``None``.

    Stages on one rank hold different names, except the two copies of a tied
    embedding under V-shaped schedules: they load from one entry, so they must
    hold the same part of it.
    """
    first = next((p for p in given if p.tied is not None and not p.copy), None)
    last = next((p for p in given if p.copy), None)
    if first is None or last is None:
        return None
    lays = [next(p.layout.record() for p in placements(part.model) if p.tensor is part.tied)
            for part in (first, last)]
    if lays[0] != lays[1]:
        return (f"the tied embedding's two copies on this rank are split differently over "
                f"TP ({lays[0]} and {lays[1]}); make the stages' embedding and LM head share "
                "one layout (the same plan style)")
    return None


def _plain(value: Any) -> Any:
    """A hyper-parameter as every rank writes it: tensors as numbers (not their device)."""
    if torch.is_tensor(value):
        return value.tolist()
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value
