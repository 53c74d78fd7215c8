"""Per-rank state dicts that know whose they are.

``wrapper.state_dict()`` holds this rank's shards only; saved per rank
(``torch.save(wrapper.state_dict(), f"ckpt.rank{rank}.pt")``) and loaded back
with ``wrapper.load_state_dict``, a file given to the wrong rank (or one
rank's file from another model with the same config) has the same names and
shapes and would load silently. So:

* :func:`stamp` records, in the state dict's ``_metadata`` (which
  ``torch.save``/``torch.load`` keep and ``nn.Module.load_state_dict``
  passes through harmlessly, so no key is added), this rank's tp size,
  rank, a digest of its layout (every tensor's split dim, ranges and full
  shape) and a model fingerprint (a digest of the replicated tensors, equal
  on every rank of one model at one moment);
* :func:`load` (``wrapper.load_state_dict``, collective over the TP group)
  checks the recorded tp/rank/layout against this rank's before loading,
  then agrees across the group on the files' fingerprints and on a digest of
  every replicated tensor after loading: any difference raises on every rank,
  naming the ranks or the parameter.

A state dict without the record (safetensors files, a dict rebuilt from the
items, plain PyTorch) loads as before; only the replicated-tensor agreement
applies to it (a wrong rank's file of evenly split tensors is then not
detectable: keep the state dict as ``state_dict()`` returned it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from ..comm.runtime import group_size
from ..core import torch_compat
from ..guards.agreement import agree
from ..guards.fingerprints import tensor_digest
from .atomic import enter
from .placements import placements

KEY = "torchtp_shard"
_WHAT = "load_state_dict"
FINGERPRINT = ("model fingerprint (sampled digest of every replicated parameter; ranks whose "
               "replicated copies differ would save an ambiguous model)")


def origin(wrap_fingerprint: dict[str, Any]) -> str:
    """Which model a wrapper was built from: a digest of what its ranks agreed on at wrap time.

    That agreement holds a sampled digest of every full tensor before slicing,
    so models built from different seeds or checkpoints differ here even when
    their replicated tensors are equal (fresh norms are all ones).
    """
    return hashlib.blake2b(repr(sorted(wrap_fingerprint.items(), key=str)).encode(),
                           digest_size=8).hexdigest()


def identity(wrapper: Any) -> dict[str, Any]:
    """What a per-rank state dict of ``wrapper`` (this rank's shards) records about itself.

    ``model`` combines the wrap-time origin with a digest of the replicated
    tensors now (equal on every rank of one model at one moment).
    """
    layout = hashlib.blake2b(digest_size=8)
    agreed = wrapper.__dict__.get("_wrap_fingerprint")
    wrap_origin = None if agreed is None else origin(agreed)
    fingerprint = hashlib.blake2b(str(wrap_origin).encode(), digest_size=8)
    for p in placements(wrapper.base_model):
        lay = p.layout  # the digest older releases wrote, plus the second cut where there is one
        key = (p.name, lay.dim, lay.segments, tuple(lay.full_shape))
        layout.update(repr(key if lay.second is None else (*key, lay.second)).encode())
        if p.layout.dim is None:  # replicated: the same bytes on every rank
            fingerprint.update(f"{p.name}={tensor_digest(p.tensor)};".encode())
    return {"tp_size": wrapper.world_size, "rank": wrapper.rank, "layout": layout.hexdigest(),
            "model": fingerprint.hexdigest()}


def stamp(state_dict: dict[str, Any], wrapper: Any) -> dict[str, Any]:
    """Record :func:`identity` in ``state_dict._metadata`` (absent: left unstamped)."""
    meta = torch_compat.state_dict_metadata(state_dict)
    if meta is not None:
        meta.setdefault("", {})[KEY] = identity(wrapper)
    return state_dict


def recorded(state_dict: Mapping[str, Any]) -> dict[str, Any] | None:
    """The identity :func:`stamp` recorded, or ``None``."""
    meta = torch_compat.state_dict_metadata(state_dict)
    entry = meta.get("", {}).get(KEY) if meta is not None else None
    return entry if isinstance(entry, dict) else None


def wrong_file(saved: dict[str, Any], mine: dict[str, Any]) -> str | None:
    """Why a state dict recorded as ``saved`` is not this rank's (``mine``), or ``None``."""
    if saved.get("tp_size") != mine["tp_size"] or saved.get("rank") != mine["rank"]:
        return (f"TP rank {mine['rank']} (tp {mine['tp_size']}) was given the state dict that "
                f"TP rank {saved.get('rank')} saved at tp {saved.get('tp_size')}: each rank holds "
                "different shards of the split parameters (rows of colwise/RowParallelLinear "
                "weights, columns of rowwise/ColumnParallelLinear weights); give every rank the "
                "file its own rank saved, at the same tp")
    if saved.get("layout") != mine["layout"]:
        return (f"TP rank {mine['rank']} was given a state dict saved with another plan "
                f"(layout digest {saved.get('layout')}, this model's is {mine['layout']}): "
                "the split dimensions or ranges differ; wrap with the plan it was saved with, "
                "or save_sharded and from_pretrained to change plans")
    return None


def load(wrapper: Any, state_dict: Mapping[str, Any], strict: bool, assign: bool) -> Any:
    """``base_model.load_state_dict`` checked as the module docstring says; collective over
    the wrapper's TP group.

    Raises:
        ValueError: on every rank, when a rank was given another rank's (or
            another plan's) state dict, naming both ranks.
        RankMismatchError: on every rank, when the ranks' files come from
            different models or saves (a replicated parameter differs after
            loading, named; else the recorded model fingerprints differ).
        RuntimeError: not every rank called it within min(60 s, TP_TIMEOUT),
            or ``nn.Module.load_state_dict``'s own errors (on every rank).
    """
    model, group = wrapper.base_model, wrapper.group
    collective = group is not None and group_size(group) > 1
    if collective:
        enter(_WHAT, group, None)
    saved = recorded(state_dict)
    error: BaseException | None = None
    result = None
    if saved is not None:
        reason = wrong_file(saved, identity(wrapper))
        error = ValueError(f"{_WHAT}: {reason}") if reason else None
    if error is None:
        try:
            result = model.load_state_dict(state_dict, strict=strict, assign=assign)
        except Exception as err:  # reported on every rank by agree()
            error = err
    if not collective:
        if error is not None:
            raise error
        return result
    prints: dict[str, Any] = {}
    if error is None:
        for p in placements(model):
            if p.layout.dim is None:
                prints[f"replicated parameter '{p.name}' after loading (sampled digest; the "
                       "ranks' state dicts come from different models or saves)"] = \
                    tensor_digest(p.tensor)
        prints["model fingerprint recorded in the loaded state dict (the ranks' files come "
               "from different models or saves)"] = saved and saved.get("model")
    agree(_WHAT, error, prints, group)
    return result


def file_metadata(ident: dict[str, Any]) -> dict[str, str]:
    """A sharded checkpoint's rank-file header metadata (safetensors ``__metadata__``: strings)."""
    return {"format": "pt", **{f"torchtp_{k}": str(v) for k, v in ident.items()}}


def check_rank_file(path: str, metadata: dict[str, str], rank: int, tp: int,
                    model: str | None) -> None:
    """Raise if a sharded checkpoint's rank file is another rank's or another save's.

    Files written before this record existed (no ``torchtp_rank``) pass.

    Raises:
        ValueError: naming the file, the rank and tp it records and the
            expected ones, or the two model fingerprints.
    """
    if "torchtp_rank" not in metadata:
        return
    saved = (metadata.get("torchtp_rank"), metadata.get("torchtp_tp_size"))
    if saved != (str(rank), str(tp)):
        raise ValueError(f"{path} holds TP rank {saved[0]}'s shards of a tp {saved[1]} save, but "
                         f"the checkpoint lists it as rank {rank}'s of tp {tp}: the rank files "
                         "were renamed or copied between checkpoints; re-save")
    if model is not None and metadata.get("torchtp_model") != model:
        raise ValueError(f"{path} comes from another model or save (model fingerprint "
                         f"{metadata.get('torchtp_model')}, the checkpoint metadata's {model}): "
                         "the rank files were copied between checkpoints; re-save")
