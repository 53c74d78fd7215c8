"""Resumable training checkpoints through ``torch.distributed.checkpoint`` (DCP).

The model's and the optimizer's tensors are handed to DCP as DTensors on the
TP mesh, so DCP writes each global tensor once (DP replicas and ranks holding
the same replicated tensor are deduplicated) and reads back whatever slice
the loading rank needs, at any tp:

* every tensor is saved in checkpoint orientation, the model's own (GPT-2's
  ``Conv1D`` weights as ``(in, out)``, whether a wrap split them into torchtp's
  ``(out, in)`` layers or kept them whole, or tp is 1), so a checkpoint loads at
  any tp, a square weight included;
* a parameter split into one even chunk per rank is ``Shard(dim)``;
* one DTensor cannot express several segments per rank (packed QKV), uneven
  chunks, or KV heads replicated over some ranks: such a tensor is
  all-gathered and saved whole (replicated); loading cuts this rank's
  segments out of it;
* everything else (replicated parameters, buffers, the optimizer's scalar
  ``step``) is a plain, replicated tensor.

The optimizer's per-parameter state (AdamW's ``exp_avg``/``exp_avg_sq``) is
stored under the parameter's name, like the parameter, so it reshards with it.

FSDP2 (``fully_shard`` over the DP mesh) holds each TP-local tensor as a
DTensor sharded over DP. Saving all-gathers it over DP first
(``full_tensor()``) and then proceeds as above, so the files are the same as
a job without FSDP2 writes (DCP deduplicates the DP copies) and load at any
dp/tp, with or without FSDP2. Loading reads the TP-local tensor and keeps
this DP rank's shard of it. Cost: while saving or loading, every rank holds
the TP-local model and optimizer state (what a TP job without FSDP2 holds)
besides its FSDP2 shards.

Pipeline jobs pass this rank's stages instead of the wrapper
(:mod:`torchtp.checkpoint.parts`): each stage saves the parameters it holds
under the unsplit model's names, as DTensors over its own TP group, and DCP
merges the stages' disjoint keys into the unsplit model's checkpoint. A tied
LM head on the last stage is saved once, by the first stage, under the
embedding's name, and loaded from it. So the checkpoint loads at any pp (a
whole model at pp 1 included) and any tp.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ..comm.objects import all_gather_object
from ..comm.runtime import ProcessGroup, get_tensor_parallel_config, group_rank, group_size
from ..core.layouts import ParamLayout, place, shard_range
from ..layers import layouts_of
from ..plans.linear_view import conv1d_type
from .atomic import enter
from .parts import Part, agree_parts, parts
from .placements import placements


def save_training_state(directory: str | os.PathLike[str], model: Any,
                        optimizer: torch.optim.Optimizer | None = None, step: int = 0,
                        extra: dict[str, Any] | None = None) -> None:
    """Collective over the world: write model, optimizer, step (and ``extra``) with DCP.

    Args:
        directory: Checkpoint directory (DCP's format; one file per rank plus metadata).
        model: The wrapped model (or a DDP around it); in a pipeline job this
            rank's stage, or its list of stages (each as it is, in DDP or
            ``fully_shard``; tensor-parallel in place or not).
        optimizer: Its optimizer (state stored per parameter name), or ``None``.
        step: The training step to resume from.
        extra: Other picklable objects to store (e.g. a scheduler's state_dict()).

    FSDP2 shards (DTensor parameters over the DP mesh) are all-gathered over
    DP first: the checkpoint does not depend on FSDP2 (see the module docstring).

    Raises:
        TypeError: ``model`` is neither the wrapper nor pipeline stages.
        ValueError: on every rank, before anything is written, when the ranks
            disagree on what they save (pipeline stages on some, a wrapper on
            others; the optimizer's hyper-parameters; ``step``).
    """
    given = parts(model, "save_training_state")
    enter("save_training_state", dist.group.WORLD if dist.is_initialized() else None, None)
    entries = _entries(given, agree_parts(given, optimizer, step, "save_training_state"))
    state = _state(entries, optimizer, for_load=False)
    state["step"] = step
    # One opaque blob: DCP would flatten a dict into keys a loading rank cannot predict.
    state["extra"] = io.BytesIO(pickle.dumps(extra or {}))
    state[ORIENTATION] = io.BytesIO(b"checkpoint")  # Conv1D weights as (in, out)
    dcp.save(state, checkpoint_id=os.fspath(directory))


def load_training_state(directory: str | os.PathLike[str], model: Any,
                        optimizer: torch.optim.Optimizer | None = None) -> tuple[int, dict]:
    """Collective: load what :func:`save_training_state` wrote, at this run's pp/tp/dp.

    ``model`` as for :func:`save_training_state`: a checkpoint saved by a
    pipeline job loads into a whole wrapped model and the other way round.

    A parameter that had no optimizer state when saved (no gradient yet) has none after
    the load either, as in the run that saved it.

    Returns:
        ``(step, extra)`` as saved.

    Raises:
        ValueError: on every rank, before anything is loaded, when the checkpoint holds
            model tensors this model lacks (another model's checkpoint); a tensor the
            model has and the checkpoint lacks raises DCP's error on every rank.
    """
    given = parts(model, "load_training_state")
    enter("load_training_state", dist.group.WORLD if dist.is_initialized() else None, None)
    entries = _entries(given, agree_parts(given, optimizer, None, "load_training_state"))
    if optimizer is not None:
        _init_optimizer_state(optimizer)
    state = _state(entries, optimizer, for_load=True)
    saved = set(dcp.FileSystemReader(os.fspath(directory)).read_metadata().state_dict_metadata)
    _refuse_old_orientation(saved, given, directory)
    _keep_saved(state, saved, directory, given[0].stage is not None)
    state["step"] = 0
    state["extra"] = io.BytesIO()
    dcp.load(state, checkpoint_id=os.fspath(directory))
    with torch.no_grad():
        _copy_back(entries, optimizer, state)
    # The blob this job's own save_training_state wrote (pickle, like torch.save).
    return int(state["step"]), pickle.loads(state["extra"].getvalue())


# The entry marking a checkpoint whose transposed (Conv1D) weights are in the model's own
# orientation; torchtp before 2026-12-08 saved split ones as (out, in) without it.
ORIENTATION = "orientation"


def _refuse_old_orientation(saved: set[str], given: list[Part], directory: Any) -> None:
    """Refuse, on every rank (the same files and model everywhere), a checkpoint without
    :data:`ORIENTATION` for a model holding ``Conv1D`` weights: a square one of it could be
    read the wrong way round without any error."""
    if ORIENTATION in saved:
        return
    conv1d = conv1d_type()
    flipped = any((conv1d is not None and isinstance(m, conv1d))
                  or any(layout.transposed for layout in layouts_of(m).values())
                  for part in given for m in part.model.modules())
    if flipped:
        raise ValueError(
            f"load_training_state({os.fspath(directory)!r}): this checkpoint was written by a "
            "torchtp that saved split Conv1D weights (GPT-2 style) transposed, and this model "
            "holds Conv1D weights: a square one would load the wrong way round; load it with "
            "the torchtp that wrote it and save it again, or start from save_pretrained's "
            "consolidated weights")


def _keep_saved(state: dict[str, Any], saved: set[str], directory: Any, stages: bool) -> None:
    """Refuse a checkpoint with model tensors the model lacks; drop the optimizer state of
    parameters that had none when saved. ``saved``: the checkpoint's keys (DCP's flattened
    names, the same on every rank: so is the verdict). Pipeline ``stages`` hold a part of
    the model each: the model's names are every rank's (one object gather)."""
    known = set(state["model"])
    if stages and dist.is_initialized() and dist.get_world_size() > 1:
        known = set().union(*all_gather_object(sorted(known), None, "the checkpoint's names"))
    unknown = sorted(k[len("model."):] for k in saved
                     if k.startswith("model.") and k[len("model."):] not in known)
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise ValueError(
            f"load_training_state({os.fspath(directory)!r}): the checkpoint holds tensors this "
            f"model does not have: {', '.join(unknown[:5])}{more}; it was saved from another "
            "model (or another configuration of it): load it into the model it was saved from")
    per_param = state.get("optim", {}).get("state", {})
    for name in [n for n in per_param if not any(k.startswith(f"optim.state.{n}.") for k in saved)]:
        del per_param[name]


class _Entry(NamedTuple):
    """One checkpoint tensor of this rank: its name, tensor, layout and TP group."""

    name: str
    tensor: torch.Tensor
    layout: ParamLayout | None
    group: Any
    copy: bool = False  # a tied copy another stage saves: loaded, never saved


def _entries(given: list[Part], tied: str | None) -> list[_Entry]:
    """Every parameter and persistent buffer of this rank's models (tied tensors once per
    model, under their first name; a last stage's tied copy under the embedding's name)."""
    out = []
    for part in given:
        for p in placements(part.model):
            if part.copy and p.tensor is part.tied:
                assert tied is not None  # agree_parts refused a copy without its first stage
                out.append(_Entry(tied, p.tensor, p.layout, part.group, True))
            else:
                out.append(_Entry(p.name, p.tensor, p.layout, part.group))
    return out


def _tp_mesh(group: ProcessGroup | None) -> DeviceMesh | None:
    cfg = get_tensor_parallel_config()
    if group is None or group_size(group) == 1:
        return None
    if cfg.mesh is not None and group is cfg.group:
        return cfg.mesh["tp"]
    return DeviceMesh.from_group(group, cfg.device.type, mesh_dim_names=("tp",))


def _expressible(layout: ParamLayout, group: ProcessGroup | None) -> bool:
    """One even chunk per rank, at this rank's index: a ``Shard(dim)``."""
    if layout.dim is None or len(layout.segments) != 1 or layout.second is not None:
        return False
    full, size = layout.full_shape[layout.dim], group_size(group)
    # Even splits only: there torchtp's rule and DTensor's ``torch.chunk`` agree.
    share = shard_range(full, size, group_rank(group))
    return full % size == 0 and tuple(layout.segments[0]) == share


def _tp_local(t: torch.Tensor, for_load: bool) -> torch.Tensor:
    """This rank's TP-local tensor: FSDP2's DP shards gathered (a buffer to load into)."""
    if not isinstance(t, DTensor):
        return t
    if for_load:
        return torch.empty(t.shape, dtype=t.dtype, device=t.to_local().device)
    with torch.no_grad():
        return t.full_tensor()  # all-gather over the DP mesh, every rank in one order


def _as_saved(t: torch.Tensor, layout: ParamLayout | None, group: Any,
              for_load: bool) -> torch.Tensor:
    """``t`` as DCP sees it, in checkpoint orientation: a Shard DTensor, a gathered full
    tensor, or itself (transposed, or a buffer to load into, where torchtp holds it
    transposed)."""
    t = _tp_local(t, for_load).detach()
    flip = layout is not None and layout.transposed  # torchtp's (out, in) of a Conv1D
    if layout is None or layout.dim is None or group is None or group_size(group) == 1:
        if not flip:
            return t
        return torch.empty(t.t().shape, dtype=t.dtype, device=t.device) if for_load else t.t()
    mesh = _tp_mesh(group)
    assert mesh is not None
    full = layout.full_shape
    if _expressible(layout, group):
        local = t.t() if flip else t  # (in, out/tp) of a Conv1D split by its out features
        if flip and for_load:  # DCP reads into a contiguous buffer; _assign transposes it
            local = torch.empty(local.shape, dtype=t.dtype, device=t.device)
        return DTensor.from_local(local, mesh, [Shard(layout.dim)], run_check=False,
                                  shape=torch.Size(full), stride=_contiguous_stride(full))
    if for_load:
        return torch.empty(full, dtype=t.dtype, device=t.device)
    return _gather_full(t, layout, group)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


def _gather_full(local: torch.Tensor, layout: ParamLayout, group: Any) -> torch.Tensor:
    """The full tensor (checkpoint orientation) from every rank's segments."""
    # Placed in checkpoint orientation, where the layout records its cuts.
    saved = local.t() if layout.transposed else local
    pieces = all_gather_object((layout.record(), saved.cpu()), group, "a DCP tensor gather")
    out = torch.empty(layout.full_shape, dtype=local.dtype, device=local.device)
    for record, tensor in pieces:
        place(out, tensor.to(out.device), *record)
    return out


def _state(entries: list[_Entry], optimizer: torch.optim.Optimizer | None,
           for_load: bool) -> dict[str, Any]:
    """DCP's state dict: one entry per name (a second tensor of a name loads from it)."""
    model: dict[str, Any] = {}
    for e in entries:
        if e.name not in model and not (e.copy and not for_load):
            model[e.name] = _as_saved(e.tensor, e.layout, e.group, for_load)
    state: dict[str, Any] = {"model": model}
    if optimizer is not None:
        by_param = {id(e.tensor): e for e in entries}
        per_param: dict[str, dict[str, Any]] = {}
        for param_group in optimizer.param_groups:
            for p in param_group["params"]:
                e = by_param[id(p)]
                if e.name in per_param or (e.copy and not for_load):
                    continue
                per_param[e.name] = {k: _as_saved(v, e.layout, e.group, for_load)
                                     if torch.is_tensor(v) and v.shape == p.shape else v
                                     for k, v in optimizer.state.get(p, {}).items()}
        hyper = [{k: v for k, v in grp.items() if k != "params"} for grp in optimizer.param_groups]
        state["optim"] = {"state": per_param, "param_groups": hyper}
    return state


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (a zero-gradient step at lr 0) so DCP can load into it."""
    if all(p in optimizer.state for g in optimizer.param_groups for p in g["params"]):
        return
    saved = [(g["lr"], g.get("weight_decay")) for g in optimizer.param_groups]
    grads = {p: p.grad for g in optimizer.param_groups for p in g["params"]}
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, (lr, _) in zip(optimizer.param_groups, saved, strict=True):
        g["lr"] = lr
    for p, grad in grads.items():
        p.grad = grad


def _copy_back(entries: list[_Entry], optimizer: torch.optim.Optimizer | None,
               state: dict[str, Any]) -> None:
    """Put loaded values that DCP could not load in place (gathered tensors, scalars, a
    second tensor of a name)."""
    for e in entries:
        _assign(e.tensor, state["model"][e.name], e.layout)
    if optimizer is None:
        return
    by_id = {id(e.tensor): e for e in entries}
    for group, hyper in zip(optimizer.param_groups, state["optim"]["param_groups"], strict=True):
        group.update(hyper)
        for p in group["params"]:
            e = by_id[id(p)]
            loaded = state["optim"]["state"].get(e.name)
            if loaded is None:  # no state when saved: none now either
                optimizer.state.pop(p, None)
                continue
            current = optimizer.state[p]
            for k, v in loaded.items():
                if torch.is_tensor(current.get(k)):
                    _assign(current[k], v, e.layout if current[k].shape == p.shape else None)
                else:
                    current[k] = v


def _assign(target: torch.Tensor, loaded: Any, layout: ParamLayout | None) -> None:
    """Copy a loaded value (TP shard DTensor, gathered full tensor, or plain; checkpoint
    orientation) into ``target``."""
    flip = layout is not None and layout.transposed
    if isinstance(loaded, DTensor):
        value = loaded.to_local().t() if flip else loaded.to_local()
    elif layout is not None and layout.dim is not None and loaded.shape != target.shape:
        value = layout.take(loaded)  # this rank's segments, in torchtp's orientation
    else:
        value = loaded.t() if flip else loaded
    if isinstance(target, DTensor):  # FSDP2: keep this DP rank's shard of the TP-local tensor
        mine = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(mine.to_local())
    elif value.data_ptr() != target.data_ptr():
        target.copy_(value)
