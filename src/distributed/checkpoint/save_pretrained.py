"""``wrapper.save_pretrained(dir)``: a consolidated HF directory, one tensor at a time.

Rank 0 writes every safetensors header first (full shapes and dtypes are
known from the layouts), then for each tensor in turn the ranks gather their
pieces to rank 0, which places them (Conv1D pieces back in ``(in, out)``
order, replicated KV heads written once by overwriting the same range) and
appends the bytes. Rank 0 holds at most one full tensor plus its pieces.
"""

from __future__ import annotations

import os
from typing import Any

from .atomic import make_tmp, step, validate
from .hf_stream import finish, gather_full, stream
from .parts import is_pipeline
from .placements import placements
from .save_sharded import gather_layouts, save_config
from .st_writer import (
    TensorSpec,
    hf_file_names,
    parse_size,
    plan_shards,
)

_WHAT = "save_pretrained"


def save_pretrained(wrapper: Any, directory: str | os.PathLike[str],
                    max_shard_size: int | str = "5GB", timeout: float | None = None) -> None:
    """Implementation of :meth:`DistributedModelWrapper.save_pretrained` (see there).

    Given this rank's pipeline stage (or list of stages) instead of a wrapper,
    the pipeline job's HF directory, every stage writing its own files:
    collective over the world (:func:`~torchtp.checkpoint.save_stages.save_stages`).
    """
    if is_pipeline(wrapper):
        from .save_stages import save_stages  # a pipeline job: each stage writes its files

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
    finish(_WHAT, tmp, directory, files, names, error, group, rank)
