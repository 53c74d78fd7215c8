"""``wrapper.save_sharded(dir)``: each rank writes its own shard, rank 0 the metadata."""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from .._version import __version__
from ..comm.objects import all_gather_object
from ..core.log import logger
from .atomic import group_size, make_tmp, publish_agreed, step, validate
from .fmt import FORMAT, FORMAT_VERSION, FORMAT_VERSION_ONE_CUT, METADATA_FILE, rank_file
from .placements import Placement, checkpoint_local, placements
from .shard_identity import FINGERPRINT, file_metadata, identity
from .st_writer import DTYPES, TensorSpec, write_file

_WHAT = "save_sharded"


def gather_layouts(items: list[Placement], group: Any) -> list[dict[str, Any]]:
    """Every rank's ``{name: (dim, segments, second)}`` (:meth:`ParamLayout.record`), indexed
    by group rank."""
    mine = {p.name: p.layout.record() for p in items}
    if group_size(group) == 1:
        return [mine]
    return all_gather_object(mine, group, "save_sharded's layout exchange")


def save_sharded(wrapper: Any, directory: str | os.PathLike[str], timeout: float | None = None) -> None:
    """Implementation of :meth:`DistributedModelWrapper.save_sharded` (see there)."""
    directory = os.fspath(directory)
    group, rank, tp = wrapper.group, wrapper.rank, wrapper.world_size
    ident = identity(wrapper)
    # Only rank 0's copy of a replicated tensor is written: ranks whose copies
    # differ (drifted) would save an ambiguous model, so they must agree first.
    tmp = validate(_WHAT, directory, group, timeout, {"tp": tp, FINGERPRINT: ident["model"]})
    error: BaseException | None = None
    if rank == 0:
        try:
            make_tmp(tmp)
        except OSError as err:
            error = err
    step(_WHAT, error, group, tmp, rank)
    items = placements(wrapper.base_model)
    layouts = gather_layouts(items, group)
    mine = [p for p in items if _writes(p.name, layouts, rank)]
    error = None
    try:
        specs = [TensorSpec(p.name, tuple(checkpoint_local(p).shape), p.tensor.dtype) for p in mine]
        by_name = {p.name: p for p in mine}
        write_file(os.path.join(tmp, rank_file(rank, tp)), specs,
                   lambda s: checkpoint_local(by_name[s.name]), file_metadata(ident))
        if rank == 0:
            _write_metadata(tmp, wrapper, items, layouts, fingerprint=ident["model"])
    except (OSError, ValueError) as err:
        error = err
    step(_WHAT, error, group, tmp, rank)
    publish_agreed(_WHAT, tmp, directory, group, rank)


def _writes(name: str, layouts: list[dict[str, Any]], rank: int) -> bool:
    """Whether ``rank`` stores ``name``: no lower rank holds the same ranges (replicas once)."""
    return all(layouts[q][name] != layouts[rank][name] for q in range(rank))


def _holders(name: str, layouts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The metadata's shard list: who stores which segments (and the second cut, if any)."""
    shards = []
    for r in range(len(layouts)):
        if _writes(name, layouts, r):
            _, segments, second = layouts[r][name]
            shards.append({"rank": r, "segments": segments}
                          | ({} if second is None else {"second": second}))
    return shards


def _write_metadata(tmp: str, wrapper: Any, items: list[Placement],
                    layouts: list[dict[str, Any]], write_config: bool = True,
                    fingerprint: str | None = None) -> None:
    model = wrapper.base_model
    config = getattr(model, "config", None)
    tensors, aliases, two_cuts = {}, {}, False
    for p in items:
        shards = _holders(p.name, layouts)
        two_cuts = two_cuts or any("second" in s for s in shards)
        tensors[p.name] = {"shape": list(p.layout.full_shape), "dtype": DTYPES[p.tensor.dtype],
                           "dim": p.layout.dim, "transposed": p.layout.transposed,
                           "shards": shards}
        aliases.update(dict.fromkeys(p.aliases, p.name))
    meta = {
        "format": FORMAT, "torchtp_version": __version__,
        # Version 1 unless a shard has a second cut, so older releases still read the rest.
        "format_version": FORMAT_VERSION if two_cuts else FORMAT_VERSION_ONE_CUT,
        "tp_size": wrapper.world_size, "model_type": getattr(config, "model_type", None),
        "architectures": [type(model).__name__],
        "plan": {"source": wrapper.resolved_plan.source, "rules": dict(wrapper.resolved_plan.rules)},
        "files": [rank_file(r, wrapper.world_size) for r in range(wrapper.world_size)],
        "aliases": aliases, "tensors": tensors,
    }
    if fingerprint is not None:  # the rank files record it too (see shard_identity)
        meta["model"] = fingerprint
    if write_config and config is not None and hasattr(config, "save_pretrained"):
        save_config(model, tmp)
    with open(os.path.join(tmp, METADATA_FILE), "w") as f:
        json.dump(meta, f, indent=1)


def save_config(model: Any, directory: str) -> None:
    """The model's HF config (and generation config) with its class and dtype recorded."""
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    first = next((p for p in model.parameters() if p.is_floating_point()), None)
    if first is not None:
        config.dtype = first.dtype
    config.save_pretrained(directory)
    gen = getattr(model, "generation_config", None)
    if gen is not None and hasattr(gen, "save_pretrained"):
        try:
            gen.save_pretrained(directory)
        except ValueError as err:  # an invalid generation config is not worth failing the save
            logger.warning("torchtp: generation_config not saved: %s", err)
