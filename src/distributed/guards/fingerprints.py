"""Cheap fingerprints that prove every TP rank holds the same weights and inputs.

A fingerprint hashes a tensor's shape, dtype and a strided sample of at most
:data:`SAMPLES` elements (not every byte): ranks built from different seeds,
or fed different float batches, differ in nearly every element, so a sample
catches them at a cost independent of the tensor's size. Integer tensors
(token ids, masks) longer than the sample add a position-weighted sum of every
element: prompts may differ in a single token. Input digests are
compared by :mod:`torchtp.guards.input_check`; weight digests by the wrapper's
agreement at wrap time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

from ..core.errors import RankMismatchError

SAMPLES = 256
# dtypes numpy holds as they are (bfloat16 and float8 are not among them)
_NUMPY = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
          torch.float64, torch.float32, torch.float16)


def sample_bytes(t: torch.Tensor) -> bytes | memoryview:
    """The bytes of a strided sample of at most :data:`SAMPLES` of ``t``'s elements (on GPU:
    a copy to the host, a synchronisation).

    numpy only ever sees a copy: ``Tensor.numpy()`` marks the tensor's storage as
    not resizable for good, and FSDP2 frees an unsharded parameter by resizing its
    storage (a replicated weight is sampled while FSDP2 holds it unsharded).
    """
    if t.is_cpu and t.numel() <= SAMPLES and t.dtype in _NUMPY and not t.requires_grad \
            and t.is_contiguous():
        # The usual input (a short batch of token ids): numpy's view of a copy, two torch
        # calls. Before every forward, right after the last forward evicted the caches,
        # each further call costs ~10 us of misses.
        return t.clone().numpy().data
    if t.device.type == "meta" or not t.numel():
        return b""
    flat = t.detach().reshape(-1)
    # Small tensors (token ids of a short batch) are taken whole: two ops fewer per forward.
    sample = flat if flat.numel() <= SAMPLES else flat[:: flat.numel() // SAMPLES][:SAMPLES]
    if flat.numel() > SAMPLES and not (flat.is_floating_point() or flat.is_complex()):
        # Ids, masks, positions: ranks fed different prompts may differ in one token only,
        # past the sample (a long prompt, the last sampled token). A wrapping sum over every
        # element with odd position weights changes with any one of them.
        weights = torch.arange(1, 2 * flat.numel(), 2, device=flat.device)  # (n,) odd
        every = (flat.to(torch.int64) * weights).sum().reshape(1)
        sample = torch.cat([sample.to(torch.int64), every])
    return sample.cpu().clone(memory_format=torch.contiguous_format).view(
        torch.uint8).numpy().tobytes()


def tensor_digest(t: torch.Tensor) -> str:
    """16 hex digits from ``t``'s shape, dtype and a strided sample of its elements."""
    h = hashlib.blake2b(f"{tuple(t.shape)}{t.dtype}".encode(), digest_size=8)
    h.update(sample_bytes(t))
    return h.hexdigest()


def _collect(value: Any, name: str, found: list[tuple[str, torch.Tensor]]) -> None:
    """Append ``(argument path, tensor)`` for every tensor inside ``value`` (dicts, lists,
    tuples) to ``found``."""
    if isinstance(value, torch.Tensor):
        found.append((name, value))
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _collect(v, f"{name}[{k!r}]", found)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _collect(v, f"{name}[{i}]", found)


def named_tensors(args: tuple[Any, ...], kwargs: Mapping[str, Any],
                  skip: tuple[str, ...] = ()) -> list[tuple[str, torch.Tensor]]:
    """``(argument path, tensor)`` for every tensor of a call's arguments.

    Keyword arguments whose name contains one of ``skip`` are left out. A list
    built by plain recursion (no generators): the input check calls this before
    every forward, where each extra Python frame costs microseconds of cache misses.
    """
    found: list[tuple[str, torch.Tensor]] = []
    for i, a in enumerate(args):
        _collect(a, f"argument {i}", found)
    for k, v in kwargs.items():
        for word in skip:
            if word in k:
                break
        else:
            _collect(v, f"argument '{k}'", found)
    return found


def raise_different_inputs(everyone: list[Mapping[str, str]], when: str) -> None:
    """Raise :class:`RankMismatchError` naming the first argument whose digests differ.

    Args:
        everyone: Each TP rank's ``{argument path: digest}``, in rank order
            (the same list on every rank, so every rank raises the same error).
        when: Which forwards are checked, for the message.
    """
    for name in dict.fromkeys(k for d in everyone for k in d):
        values = [d.get(name) for d in everyone]
        if any(v != values[0] for v in values):
            differ = [r for r, v in enumerate(values) if v != values[0]]
            raise RankMismatchError(
                f"tensor-parallel ranks received different inputs ({when} is checked): "
                f"{name} differs on TP ranks {differ} from TP rank 0. Every rank of a TP group "
                "must get the same batch; the likely cause is a data sampler that splits data "
                "across TP ranks (a DistributedSampler over the whole world): shard data over "
                "cfg.dp_size/cfg.dp_rank instead (see docs/training.md); with generate(), "
                "every TP rank must pass the same prompt")
    raise RankMismatchError(
        "tensor-parallel ranks received different inputs (their digests differ) but the "
        "per-argument digests agree; every rank of a TP group must get the same batch")
