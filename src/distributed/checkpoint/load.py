"""``DistributedModelWrapper.from_pretrained``: every rank reads only its shard.

Steps, each ending in an agreement so a bad checkpoint raises on every rank:

1. open the checkpoint (headers only) and its config;
2. build the model with meta parameters and wrap it (same plan resolution as
   the wrapper; layouts are computed from shapes alone);
3. check every parameter is in the checkpoint with the full shape the layout
   expects;
4. read this rank's segments of each tensor, replicated tensors in full, and
   put them in place of the meta parameters (tied ones stay tied), then
   re-install gradient hooks.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from ..comm.devices import default_device
from ..comm.runtime import ProcessGroup, group_size
from ..core.log import logger
from ..core.torch_compat import set_module_tensor
from ..guards.agreement import agree
from ..guards.fingerprints import tensor_digest
from ..layers import grad_sync
from .build import build_on_meta, load_config
from .expert_files import merged_experts
from .placements import Placement, placements
from .sources import Source, TorchTPSource, open_source, read_layout

_WHAT = "from_pretrained"


class Wrapped(Protocol):
    """What loading needs of the wrapped model (:class:`~torchtp.DistributedModelWrapper`)."""

    @property
    def base_model(self) -> nn.Module: ...
    @property
    def rank(self) -> int: ...


W = TypeVar("W", bound=Wrapped)


def from_pretrained(
    wrap: Callable[[nn.Module], W], path: str | os.PathLike[str], plan: object = None,
    dtype: torch.dtype | None = None, device: torch.device | str | None = None,
    model_class: type | None = None, group: ProcessGroup | None = None, progress: bool = True,
    aliases: Mapping[str, str] | None = None, partial: bool = False,
) -> W:
    """Build the model on meta, ``wrap`` it, and read only this rank's shard of each tensor.

    The implementation of :meth:`DistributedModelWrapper.from_pretrained` (see
    there for the arguments); ``wrap`` makes the model tensor-parallel with the
    same ``plan`` and ``group`` (the plan is passed here only to check that
    every rank uses the same one). ``aliases``: for a tensor of the wrapped
    model the checkpoint lacks, the checkpoint tensor to read instead (a
    pipeline stage's own copy of a tied weight); read once ``wrap`` returned,
    so ``wrap`` may fill it. ``partial``: the model holds only some of the
    checkpoint's tensors (a pipeline stage), so a torchtp checkpoint's other
    tensors do not mean it belongs to another model.
    """
    path = os.fspath(path)
    source, config, error = None, None, None
    try:
        source = open_source(path)
        config = load_config(path)
    except (ValueError, TypeError) as err:
        error = err
    # Ranks given different checkpoints (or arguments) would load a silent mix;
    # paths may differ across nodes, so compare what was read, not where.
    prints = _fingerprint(config, dtype, plan)
    if source is not None:
        prints.update(_content_fingerprint(source))
    agree(_WHAT, error, prints, group)
    assert source is not None
    model = build_on_meta(config, model_class)
    wrapper = _wrap(wrap, model, group, source)
    found, error = None, None
    try:
        # Hub MoE checkpoints keep each expert as its own tensors: read them merged.
        source = merged_experts(source, wrapper.base_model)
        found = _check(wrapper.base_model, source, config, aliases or {}, partial)
    except ValueError as err:
        error = err
    agree(_WHAT, error, {}, group)
    assert found is not None
    error = None
    try:
        _materialise(wrapper, source, found, dtype, default_device(device), progress)
    except (ValueError, OSError, RuntimeError) as err:
        error = err if isinstance(err, ValueError) else ValueError(f"reading {path}: {err}")
    agree(_WHAT, error, {}, group)
    grad_sync.install(wrapper.base_model)
    return wrapper


def _content_fingerprint(source: Source) -> dict[str, str]:
    """A digest of two sampled rows of every checkpoint tensor: a stale per-node copy
    with the same config differs here (reads a few KB per tensor)."""
    prints = {}
    for name in sorted(source.names()):
        shape = source.shape(name)
        if not shape or not shape[0]:
            rows = source.read(name)
        else:
            rows = source.read(name, 0, ((0, 1), (shape[0] // 2, 1)))
        prints[f"checkpoint tensor '{name}' (sampled digest; a stale or different copy of "
               "the checkpoint on some node?)"] = tensor_digest(rows)
    return prints


def _fingerprint(config: Any, dtype: torch.dtype | None, plan: object) -> dict[str, str]:
    digest = hashlib.sha256(config.to_json_string().encode()).hexdigest()[:16] if config else ""
    return {"model config (sha256)": digest, "dtype": str(dtype), "plan": repr(plan)}


def _wrap(wrap: Callable[[nn.Module], W], model: nn.Module, group: ProcessGroup | None,
          source: Source) -> W:
    try:
        return wrap(model)
    except ValueError as err:
        if isinstance(source, TorchTPSource):
            here = group_size(group)
            raise ValueError(f"torchtp checkpoint {source.path} was saved at tp={source.tp_size} "
                             f"and cannot be loaded at the current tp={here}: {err}") from err
        raise


def _lookup(p: Placement, names: set[str], prefix: str) -> str | None:
    for name in p.names:
        for candidate in (name, f"{prefix}.{name}", name.removeprefix(f"{prefix}.")):
            if candidate in names:
                return candidate
    return None


def _check(model: nn.Module, source: Source, config: Any,
           aliases: Mapping[str, str] | None = None, partial: bool = False) -> dict[str, str]:
    """Checkpoint name of each placement (buffers may be absent); raises on any mismatch."""
    names = source.names()
    prefix = getattr(model, "base_model_prefix", "") or "\0"
    found: dict[str, str] = {}
    missing = []
    for p in placements(model):
        name = _lookup(p, names, prefix)
        if name is None and aliases and aliases.get(p.name) in names:
            name = aliases[p.name]
        if name is None:
            if p.is_param:
                missing.append(p.name)
            continue
        if source.shape(name) != p.layout.full_shape:
            raise ValueError(
                f"{source.kind} {source.path}: tensor '{name}' has shape "
                f"{list(source.shape(name))} but the model built from its config.json expects "
                f"{list(p.layout.full_shape)}; the weights and config.json belong to different "
                "models (or the config was edited)")
        found[p.name] = name
    if missing:
        where = ("model.safetensors.index.json and its files"
                 if os.path.isfile(os.path.join(source.path, "model.safetensors.index.json"))
                 else "its safetensors files")
        raise ValueError(f"{source.kind} {source.path}: {len(missing)} parameter(s) of the model "
                         f"are not in {where}: {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
                         "the checkpoint is incomplete or belongs to another model")
    if isinstance(source, TorchTPSource):
        _check_same_model(source, config, None if partial else set(found.values()))
    return found


def _check_same_model(source: TorchTPSource, config: Any, used: set[str] | None) -> None:
    saved = source.meta.get("model_type")
    here = getattr(config, "model_type", None)
    extra = [] if used is None else sorted(source.names() - used)
    if saved != here or extra:
        raise ValueError(
            f"torchtp checkpoint {source.path}: its metadata describes another model "
            f"(model_type {saved!r} vs config.json's {here!r}; tensors the model does not have: "
            f"{extra[:5]}); the metadata and config.json come from different saves")


def _materialise(wrapper: Wrapped, source: Source, found: dict[str, str], dtype: torch.dtype | None,
                 device: torch.device, progress: bool) -> None:
    from tqdm.auto import tqdm

    model = wrapper.base_model
    todo = [p for p in placements(model) if p.name in found]
    show = progress and wrapper.rank == 0 and sys.stderr.isatty()
    # delay: no bar at all when loading finishes within a second.
    for p in tqdm(todo, desc="torchtp: loading shards", unit="tensor", disable=not show, delay=1.0):
        layout = p.layout
        t = read_layout(source, found[p.name], layout)  # checkpoint orientation
        if layout.transposed:
            t = t.t()
        # One copy, straight to the device, converted on the way: no second
        # full-size host copy of the shard.
        cast = dtype if dtype is not None and t.is_floating_point() else None
        t = t.to(device=device, dtype=cast).contiguous()
        # One new Parameter for all owners: tied weights stay tied.
        new = nn.Parameter(t, requires_grad=p.tensor.requires_grad) if p.is_param else t
        for mod_name, attr in p.owners:
            module = model.get_submodule(mod_name)
            set_module_tensor(module, attr, new, p.is_param)
    for module in model.modules():
        for attr, b in list(module.named_buffers(recurse=False)):
            if b.device != device:
                set_module_tensor(module, attr, b.to(device), is_param=False)
    left = [n for n, t in model.named_parameters() if t.is_meta]
    if left:
        raise RuntimeError(f"parameters left unloaded: {left[:5]}")
    logger.debug("from_pretrained: loaded %d tensors from %s", len(todo), source.path)

