"""``save_pretrained`` of a pipeline job: one HF directory, written by the stages together.

Every rank of the world calls it with its stage(s). Each stage's tensors are
gathered over the stage's TP group, one at a time, as
:func:`~torchtp.checkpoint.save_pretrained.save_pretrained` gathers a wrapped
model's, and the group's first rank writes them into the stage's own
safetensors files (data-parallel replicas of a stage: only the replica with
the lowest ranks writes; under FSDP2 every replica gathers its shards, as
FSDP2's all-gather needs). The world's first rank writes the config and
``model.safetensors.index.json``. File names are HF's, numbered over all
stages (``model-00001-of-00002.safetensors``, ...), and tensors keep the
unsplit model's names and dtypes, so the directory is what ``transformers``
writes for the unsplit model: ``from_pretrained`` loads it in one process.
A tied LM head (the last stage's copy of the input embedding) is left out,
as ``transformers`` leaves out a tied weight.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..comm.objects import all_gather_object
from ..comm.runtime import group_rank
from .atomic import make_tmp, step, validate
from .hf_stream import finish, gather_full, stream
from .parts import Part, parts
from .placements import placements
from .save_sharded import gather_layouts, save_config
from .st_writer import TensorSpec, hf_file_names, parse_size, plan_shards

_WHAT = "save_pretrained"


@dataclass(frozen=True)
class _Held:
    """One stage as one rank holds it: what the other ranks need to plan the files."""

    stage: int
    stages: int
    tp_ranks: tuple[int, ...]  # the world ranks of its TP group
    tp_rank: int
    specs: tuple[TensorSpec, ...]  # its tensors: full shapes, the model's dtypes


def save_stages(model: Any, directory: str | os.PathLike[str], max_shard_size: int | str = "5GB",
                timeout: float | None = None) -> None:
    """Collective over the world: this rank's pipeline stage(s) into one HF directory.

    Args:
        model: This rank's stage or list of stages (tensor-parallel in place or not).
        directory: The output directory (replaced atomically, as every save does).
        max_shard_size: Largest file; a stage's tensors go into files of its own.
        timeout: Bound of the entry check (every rank must call it).

    Raises:
        ValueError: on every rank, when a stage of the pipeline is held by no
            rank, or the output cannot be written.
    """
    given = parts(model, _WHAT)
    directory = os.fspath(directory)
    world = dist.group.WORLD if dist.is_initialized() else None
    rank = dist.get_rank() if world is not None else 0
    max_bytes = parse_size(max_shard_size)  # before the temp dir exists: a bad size leaves nothing
    tmp = validate(_WHAT, directory, world, timeout, {"max_shard_size": str(max_shard_size)})
    mine = [_held(part, rank) for part in given]
    everyone = [mine] if world is None or dist.get_world_size() == 1 \
        else all_gather_object(mine, world, "save_pretrained's stage exchange")
    files, writers = _plan(everyone, max_bytes)
    names = hf_file_names(sum(len(f) for f in files.values()))
    error: BaseException | None = None
    if rank == 0:
        try:
            make_tmp(tmp)
            if hasattr(getattr(given[0].model, "config", None), "save_pretrained"):
                save_config(given[0].model, tmp)
        except (OSError, ValueError) as err:
            error = err
    step(_WHAT, error, world, tmp, rank)
    error = None
    for part in given:
        assert part.stage is not None  # parts() of a pipeline: every part is a stage
        writes = rank in writers[part.stage]  # else another data-parallel replica writes it
        if writes or _fsdp(part):  # FSDP2 shards: every replica takes part in the gathers
            first = sum(len(files[s]) for s in files if s < part.stage)  # its files' numbers
            own = files[part.stage]
            failed = _write(tmp, part, own, names[first:first + len(own)], writes)
            error = error or failed  # after a failed write the gathers still go on
    every_file = [f for s in sorted(files) for f in files[s]]
    finish(_WHAT, tmp, directory, every_file, names, error, world, rank)


def _write(tmp: str, part: Part, files: list[list[TensorSpec]], names: list[str],
           writes: bool) -> BaseException | None:
    """Collective over the stage's TP group (and over DP for FSDP2 shards): gather each
    tensor; the group's first rank writes ``files`` if ``writes``. Its write error, if any."""
    items = placements(part.model)
    layouts = gather_layouts(items, part.group)
    by_name = {p.name: p for p in items}

    def produce(spec: TensorSpec) -> Any:
        p = by_name[spec.name]
        if isinstance(p.tensor, DTensor):  # FSDP2: all-gather the TP-local tensor over DP
            p = replace(p, tensor=p.tensor.full_tensor())
        return gather_full(p, layouts, part.group)

    return stream(tmp, files, names, produce, writes and group_rank(part.group) == 0)


def _fsdp(part: Part) -> bool:
    """The stage's parameters are FSDP2 shards (DTensors over the DP mesh)."""
    return any(isinstance(p, DTensor) for p in part.model.parameters())


def _held(part: Part, rank: int) -> _Held:
    """What this rank writes of ``part`` if it writes: every tensor but a tied copy."""
    assert part.stage is not None
    tp = tuple(dist.get_process_group_ranks(part.group)) if part.group is not None else (rank,)
    specs = tuple(TensorSpec(p.name, p.layout.full_shape, p.tensor.dtype)
                  for p in placements(part.model) if not (part.copy and p.tensor is part.tied))
    return _Held(part.stage, part.stages, tp, group_rank(part.group), specs)


def _plan(everyone: list[list[_Held]], max_bytes: int
          ) -> tuple[dict[int, list[list[TensorSpec]]], dict[int, tuple[int, ...]]]:
    """Each stage's files (in stage order; a name held by several stages goes with the
    first) and the world ranks of the TP group that writes it. The same on every rank.

    Raises:
        ValueError: some stage of the pipeline is held by no rank.
    """
    by_stage: dict[int, tuple[int, _Held]] = {}
    for r, held in enumerate(everyone):
        for h in held:
            if h.tp_rank == 0 and (h.stage not in by_stage or r < by_stage[h.stage][0]):
                by_stage[h.stage] = (r, h)
    stages = max(h.stages for held in everyone for h in held)
    missing = sorted(set(range(stages)) - set(by_stage))
    if missing:
        raise ValueError(f"{_WHAT}: pipeline stages {missing} of {stages} are held by no rank; "
                         "every rank of the job must call it with its stage(s)")
    files: dict[int, list[list[TensorSpec]]] = {}
    written: set[str] = set()
    for s in range(stages):
        specs = [spec for spec in by_stage[s][1].specs if spec.name not in written]
        written.update(spec.name for spec in specs)
        files[s] = plan_shards(specs, max_bytes) if specs else []
    return files, {s: h.tp_ranks for s, (_, h) in by_stage.items()}
