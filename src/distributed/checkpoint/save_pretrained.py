"""``wrapper.save_pretrained(dir)``: a consolidated HF directory, one tensor at a time.

Rank 0 writes every safetensors header first (full shapes and dtypes are
known from the layouts), then for each tensor in turn the ranks gather their
pieces to rank 0, which places them (Conv1D pieces back in ``(in, out)``
order, replicated KV heads written once by overwriting the same range) and
appends the bytes. Rank 0 holds at most one full tensor plus its pieces.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed as dist

from ..core.layouts import held_shape, place
from .atomic import group_size, make_tmp, publish_agreed, step, validate
from .parts import is_pipeline
from .placements import Placement, checkpoint_local, placements
from .save_sharded import gather_layouts, save_config
from .st_writer import (
    TensorSpec,
    hf_file_names,
    parse_size,
    plan_shards,
    tensor_bytes,
    write_index,
)
from .st_writer import header_bytes as _header

_WHAT = "save_pretrained"


def save_pretrained(wrapper: Any, directory: str | os.PathLike[str],
                    max_shard_size: int | str = "5GB", timeout: float | None = None) -> None:
    """Implementation of :meth:`DistributedModelWrapper.save_pretrained` (see there).

    Given this rank's pipeline stage (or list of stages) instead of a wrapper,
    the pipeline job's HF directory, every stage writing its own files:
    collective over the world (:func:`~torchtp.checkpoint.save_stages.save_stages`).
    """
    if is_pipeline(wrapper):
        from .save_stages import save_stages  # it builds on this module's gather and stream

        save_stages(wrapper, directory, max_shard_size, timeout)
        return
    directory = os.fspath(directory)
    group, rank = wrapper.group, wrapper.rank
    max_bytes = parse_size(max_shard_size)  # before the temp dir exists: a bad size leaves nothing
    tmp = validate(_WHAT, directory, group, timeout, {"max_shard_size": str(max_shard_size)})
    error: BaseException | None = None
    if rank == 0:
        try:
            make_tmp(tmp)
            if hasattr(getattr(wrapper.base_model, "config", None), "save_pretrained"):
                save_config(wrapper.base_model, tmp)
        except (OSError, ValueError) as err:
            error = err
    step(_WHAT, error, group, tmp, rank)
    items = placements(wrapper.base_model)
    layouts = gather_layouts(items, group)
    specs = [TensorSpec(p.name, p.layout.full_shape, p.tensor.dtype) for p in items]
    files = plan_shards(specs, max_bytes)
    names = hf_file_names(len(files))
    by_name = {p.name: p for p in items}
    error = stream(tmp, files, names, lambda s: gather_full(by_name[s.name], layouts, group),
                   rank == 0)
    if rank == 0 and error is None and len(files) > 1:
        try:
            write_index(tmp, files, names)
        except OSError as err:
            error = err
    step(_WHAT, error, group, tmp, rank)
    publish_agreed(_WHAT, tmp, directory, group, rank)


def stream(tmp: str, files: list[list[TensorSpec]], names: list[str], produce: Any,
           writer: bool) -> BaseException | None:
    """Every rank calls ``produce`` for every tensor in order; the ``writer`` writes them.

    A write error on the writer is remembered, not raised: the other ranks are
    still gathering, so the writer keeps taking part and reports it afterwards.
    """
    error: BaseException | None = None
    for group_specs, fname in zip(files, names, strict=True):
        fh = None
        if writer and error is None:
            try:
                fh = open(os.path.join(tmp, fname), "wb")  # noqa: SIM115
                fh.write(_header(group_specs))
            except OSError as err:
                error = err
        try:
            for spec in group_specs:
                t = produce(spec)
                if fh is not None and error is None:
                    try:
                        fh.write(tensor_bytes(t))
                    except OSError as err:
                        error = err
                del t
        finally:
            if fh is not None:
                fh.close()
    return error


def gather_full(p: Placement, layouts: list[dict[str, Any]], group: Any) -> torch.Tensor | None:
    """The full tensor on group rank 0 (``None`` elsewhere); collective for split tensors."""
    local = checkpoint_local(p).contiguous()  # checkpoint orientation
    full_shape = p.layout.full_shape
    if p.layout.dim is None or group_size(group) == 1:
        return local.cpu() if p.layout.dim is None else _place_one(local, p)
    counts = [held_shape(full_shape, *lay[p.name]) for lay in layouts]
    width = max(math.prod(s) for s in counts) * local.element_size()
    flat = torch.zeros(width, dtype=torch.uint8, device=local.device)
    flat[: local.numel() * local.element_size()] = local.reshape(-1).view(torch.uint8)
    me = dist.get_rank(group)
    pieces = [torch.empty_like(flat) for _ in layouts] if me == 0 else None
    dist.gather(flat, pieces, dst=dist.get_global_rank(group, 0), group=group)
    if pieces is None:
        return None
    full = torch.empty(full_shape, dtype=local.dtype)
    for piece, shape, lay in zip(pieces, counts, layouts, strict=True):
        nbytes = math.prod(shape) * local.element_size()
        part = piece[:nbytes].cpu().view(local.dtype).reshape(shape)
        place(full, part, *lay[p.name])
    return full


def _place_one(local: torch.Tensor, p: Placement) -> torch.Tensor:
    full = torch.empty(p.layout.full_shape, dtype=local.dtype)
    place(full, local.cpu(), *p.layout.record())
    return full
