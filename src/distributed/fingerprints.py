"""Cheap fingerprints that prove every TP rank holds the same weights and inputs.

A fingerprint hashes a tensor's shape, dtype and a strided sample of at most
:data:`SAMPLES` elements (not every byte): ranks built from different seeds,
or fed different batches, differ in nearly every element, so a sample
catches them at a cost independent of the tensor's size. Comparing is one
``all_gather_object`` of the digests over the TP group.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from . import _logging
from ._objects import all_gather_object
from .errors import RankMismatchError
from .runtime import ProcessGroup, group_size

SAMPLES = 256


def tensor_digest(t: torch.Tensor) -> str:
    """16 hex digits from ``t``'s shape, dtype and a strided sample of its elements."""
    h = hashlib.blake2b(f"{tuple(t.shape)}{t.dtype}".encode(), digest_size=8)
    if t.device.type != "meta" and t.numel():
        flat = t.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // SAMPLES)][:SAMPLES]
        h.update(sample.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _tensors(value: Any, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(argument path, tensor)`` for every tensor inside ``value`` (dicts, lists, tuples)."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _tensors(v, f"{name}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors(v, f"{name}[{i}]")


def input_check_requested() -> bool:
    """``TP_CHECK_INPUTS=1``: check the inputs of every forward, not only the first.

    Read once, with ``TP_DEBUG`` and ``TP_CHECK_SHAPES`` (:func:`torchtp.configure_from_env`).
    """
    return _logging.CHECK_INPUTS


def check_same_inputs(args: tuple[Any, ...], kwargs: dict[str, Any],
                      group: ProcessGroup | None) -> None:
    """Raise :class:`RankMismatchError` on every rank if TP ranks got different inputs.

    Collective over ``group`` (one ``all_gather_object`` of a few digests).
    """
    if group is None or group_size(group) == 1:
        return
    named = [*(_tensors(a, f"argument {i}") for i, a in enumerate(args)),
             *(_tensors(v, f"argument '{k}'") for k, v in kwargs.items())]
    mine = {name: tensor_digest(t) for gen in named for name, t in gen}
    everyone = all_gather_object(mine, group, "the input check")
    for name in dict.fromkeys(k for d in everyone for k in d):
        values = [d.get(name) for d in everyone]
        if any(v != values[0] for v in values):
            differ = [r for r, v in enumerate(values) if v != values[0]]
            raise RankMismatchError(
                f"DistributedModelWrapper: tensor-parallel ranks received different inputs: "
                f"{name} differs on TP ranks {differ} from TP rank 0. Every rank of a TP group "
                "must get the same batch; the likely cause is a data sampler that splits data "
                "across TP ranks (a DistributedSampler over the whole world): shard data over "
                "cfg.dp_size/cfg.dp_rank instead (see docs/training.md)")
