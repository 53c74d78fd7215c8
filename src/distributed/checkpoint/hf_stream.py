"""Full tensors into HF safetensors files: gathered over a TP group, streamed one by one.

Shared by :func:`~torchtp.checkpoint.save_pretrained.save_pretrained` (a
wrapped model) and :mod:`~torchtp.checkpoint.save_stages` (pipeline stages,
each writing its own files), and by PEFT adapter saves: at most one full
tensor is held at a time.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed as dist

from ..core.layouts import held_shape, place
from .atomic import group_size, publish_agreed, step
from .placements import Placement, checkpoint_local
from .st_writer import TensorSpec, tensor_bytes, write_index
from .st_writer import header_bytes as _header


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


def finish(what: str, tmp: str, directory: str, files: list[list[TensorSpec]], names: list[str],
           error: BaseException | None, group: Any, rank: int) -> None:
    """Rank 0 writes the index of a sharded directory; then every rank agrees and the
    directory is published (or every rank raises the first error)."""
    if rank == 0 and error is None and len(files) > 1:
        try:
            write_index(tmp, files, names)
        except OSError as err:
            error = err
    step(what, error, group, tmp, rank)
    publish_agreed(what, tmp, directory, group, rank)
