"""Reshard and consolidate on one machine, without a process group.

Both stream: each output tensor is read from the source's byte ranges,
written, and dropped before the next one, so memory stays around the largest
tensor whatever the model size.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from ..core.log import logger
from ..plans import ResolvedPlan, ShardContext, apply_plan, resolve_plan
from .atomic import TMP_SUFFIX, check_target, make_tmp, publish
from .build import build_on_meta, load_config
from .fmt import rank_file
from .load import _check
from .placements import placements
from .save_sharded import _write_metadata, _writes
from .sources import Source, TorchTPSource, open_source, read_layout
from .st_writer import TensorSpec, hf_file_names, parse_size, plan_shards, write_file, write_index

_CONFIG_FILES = ("config.json", "generation_config.json")


def _copy_configs(src: str, tmp: str) -> None:
    for name in _CONFIG_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(tmp, name))


@dataclass
class _RankModel:
    """One target rank's model on the meta device, planned and swapped as the wrapper would."""

    base_model: nn.Module
    world_size: int
    rank: int
    resolved_plan: ResolvedPlan


def _plan_rank(model: nn.Module, tp: int, rank: int, plan: Any) -> _RankModel:
    ctx = ShardContext(tp, rank, None, type(model).__name__)
    resolved = resolve_plan(model, plan, ctx)
    apply_plan(model, resolved, ctx)
    return _RankModel(model, tp, rank, resolved)


def _saved_tp(source: Source) -> str:
    return f"tp={source.tp_size}" if isinstance(source, TorchTPSource) else "tp=1 (an HF directory)"


def reshard(src: str | os.PathLike[str], dst: str | os.PathLike[str], tp: int,
            plan: Any = None, model_class: type | None = None) -> None:
    """Write the checkpoint at ``src`` as a torchtp sharded checkpoint for ``tp`` ranks.

    Args:
        src: A torchtp sharded checkpoint (any saved tp) or an HF model directory.
        dst: Output directory; replaced only once fully written.
        tp: Target tensor-parallel size.
        plan: Plan for the target layout (same resolution as the wrapper).
        model_class: Model class to build from ``config.json`` (default: its architecture).

    Raises:
        ValueError: unreadable or inconsistent source, a tp the model's dimensions
            do not allow (naming the saved tp, ``tp`` and the dimension), or an
            unwritable ``dst``.
    """
    src, dst = os.fspath(src), os.fspath(dst)
    source, config = open_source(src), load_config(src)
    check_target(dst)
    wrappers = []
    for rank in range(tp):
        try:
            wrappers.append(_plan_rank(build_on_meta(config, model_class), tp, rank, plan))
        except ValueError as err:
            raise ValueError(f"checkpoint {src} (saved at {_saved_tp(source)}) cannot be "
                             f"resharded to tp={tp}: {err}") from err
    found = _check(wrappers[0].base_model, source, config)
    per_rank = [placements(w.base_model) for w in wrappers]
    layouts = [{p.name: p.layout.record() for p in items} for items in per_rank]
    for items in per_rank:
        for p in items:  # meta tensors with the checkpoint's dtypes, for the metadata
            p.tensor = torch.empty(p.tensor.shape, dtype=source.dtype(found[p.name]), device="meta")
    tmp = os.path.abspath(dst) + TMP_SUFFIX
    make_tmp(tmp)
    try:
        for rank, items in enumerate(per_rank):
            mine = [p for p in items if p.name in found and _writes(p.name, layouts, rank)]
            specs = [TensorSpec(p.name, p.layout.saved_shape, p.tensor.dtype) for p in mine]
            by_name = {p.name: p for p in mine}
            # The default argument binds this rank's placements; mypy cannot infer such a lambda.
            produce = cast("Callable[[TensorSpec], torch.Tensor]",
                           lambda s, b=by_name: read_layout(source, found[s.name],
                                                            b[s.name].layout))
            # Rank and tp only: no model is in memory to fingerprint (see shard_identity).
            write_file(os.path.join(tmp, rank_file(rank, tp)), specs, produce,
                       {"format": "pt", "torchtp_rank": str(rank), "torchtp_tp_size": str(tp)})
        _write_metadata(tmp, wrappers[0], [p for p in per_rank[0] if p.name in found], layouts,
                        write_config=False)
        _copy_configs(src, tmp)
        publish(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("torchtp: resharded %s (%s) -> %s (tp=%d)", src, _saved_tp(source), dst, tp)


def consolidate(src: str | os.PathLike[str], dst: str | os.PathLike[str],
                max_shard_size: int | str = "5GB") -> None:
    """Write the checkpoint at ``src`` as one HF-format directory (no process group).

    Args:
        src: A torchtp sharded checkpoint (or an HF directory, to re-shard files by size).
        dst: Output directory; replaced only once fully written.
        max_shard_size: Largest safetensors file (bytes or ``"5GB"``); more files
            come with ``model.safetensors.index.json``.

    Raises:
        ValueError: unreadable or inconsistent source, or an unwritable ``dst``.
    """
    src, dst = os.fspath(src), os.fspath(dst)
    source = open_source(src)
    check_target(dst)
    order = list(source.tensors) if isinstance(source, TorchTPSource) else sorted(source.names())
    specs = [TensorSpec(n, source.shape(n), source.dtype(n)) for n in order]
    files = plan_shards(specs, parse_size(max_shard_size))
    names = hf_file_names(len(files))
    tmp = os.path.abspath(dst) + TMP_SUFFIX
    make_tmp(tmp)
    try:
        for group, fname in zip(files, names, strict=True):
            write_file(os.path.join(tmp, fname), group, lambda s: source.read(s.name))
        if len(files) > 1:
            write_index(tmp, files, names)
        _copy_configs(src, tmp)
        publish(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
