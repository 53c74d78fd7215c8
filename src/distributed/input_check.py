"""Check on every forward of a wrapped model that all TP ranks got the same inputs.

Hooks on the wrapped model (``base_model``) run however it is called: through
the wrapper, directly (``TensorParallelTrainer``), by HF's ``generate``, or by
a PEFT model around it. Training and eval alike.

Cost: before the forward, a strided sample of at most
:data:`~torchtp.fingerprints.SAMPLES` elements of each input tensor is hashed
on its device (integer arithmetic on the sample's bytes: deterministic, no
host copy) into :data:`_BYTES` digest bytes ``b``. The values ``(b, b*b)``
ride along with the forward's first float32/float64 all-reduce over the TP
group (:func:`torchtp._comm.ride_next_all_reduce`: appended to its buffer, the
model's values copied back untouched), so no extra collective runs. After the
forward every rank reads the sums ``S = sum(b)``, ``Q = sum(b*b)``: the ranks'
bytes are all equal exactly when ``tp * Q == S * S`` (Cauchy-Schwarz), and
every rank reads the same sums, so every rank gives the same verdict. A
forward without such an all-reduce (a replicated model, half-precision
activations, sequence parallelism's gathers) pays one small separate
all-reduce of the 16 values. Only on a mismatch does an ``all_gather_object``
of per-argument digests name the argument and the ranks.

Inputs of a first parallel layer that takes this rank's input shard (a
``ColumnParallelLinear``, weight columns = ``in_features`` split, style
``"rowwise"``): floating tensors whose last dimension is this rank's share of
``in_features`` are compared by shape only (the last dimension excluded: the
balanced split may give ranks shares that differ by one).

Not checked: keyword arguments that hold a cache (``past_key_values``: each
rank's heads), forwards inside ``torch.compile``, groups of one rank, and
everything under ``TP_CHECK_INPUTS=0``.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import _comm, _logging
from .fingerprints import SAMPLES, named_tensors, raise_different_inputs, tensor_digest
from .layers import ColumnParallelLinear
from .runtime import ProcessGroup

_PRIME = 2_147_483_647  # 2**31 - 1: products with a byte stay far below 2**63
_BYTES = 8  # two 31-bit hashes, 4 bytes each
_SKIP = ("past", "cache")  # keyword arguments holding each rank's shard of a KV cache
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


@dataclass
class _Forward:
    """One forward's check: its inputs (for the slow, naming path) and the riding digest."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    ride: _comm.Ride


def guard_inputs(module: nn.Module, group: ProcessGroup, shard_width: int | None) -> None:
    """Check ``module``'s inputs on every forward (see the module docstring).

    Args:
        module: The wrapped model.
        group: The TP group (more than one rank).
        shard_width: This rank's share of ``in_features`` when the model's first
            parallel layer takes input shards; ``None`` otherwise.
    """
    pending: list[_Forward] = []

    def before(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        pending.clear()
        if not _logging.CHECK_INPUTS or torch.compiler.is_compiling():
            return
        values = _encoded(_digest(_checked(args, kwargs), shard_width))
        if values is not None:
            pending.append(_Forward(args, kwargs, _comm.ride_next_all_reduce(group, values)))

    def returned(_module: nn.Module, _args: tuple[Any, ...], _kwargs: dict[str, Any],
                 _out: Any) -> None:
        if pending:
            fwd = pending.pop()
            _verdict(fwd, group, shard_width)

    def cleanup(_module: nn.Module, _args: tuple[Any, ...], _kwargs: dict[str, Any],
                _out: Any) -> None:
        if pending:  # the forward raised: its digest must not ride a later all-reduce
            _comm.cancel_ride(group, pending.pop().ride)

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(returned, with_kwargs=True)
    module.register_forward_hook(cleanup, with_kwargs=True, always_call=True)


def first_layer_shard_width(model: nn.Module, layer_names: list[str]) -> int | None:
    """This rank's share of ``in_features`` if the first parallel layer takes input shards."""
    if not layer_names:
        return None
    first = model.get_submodule(layer_names[0])
    if isinstance(first, ColumnParallelLinear) and first.input_is_parallel:
        return int(first.in_features_local)
    return None


def _checked(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    yield from named_tensors(args, kwargs, _SKIP)


def _shape_only(t: torch.Tensor, shard_width: int | None) -> bool:
    return shard_width is not None and t.is_floating_point() and t.dim() > 0 \
        and t.shape[-1] == shard_width


def _digest(tensors: Iterator[tuple[str, torch.Tensor]],
            shard_width: int | None) -> torch.Tensor | None:
    """Two 31-bit hashes (int64, on the inputs' device) of every tensor's shape and sample."""
    code = 0
    pieces = []
    for name, t in tensors:
        shape_only = _shape_only(t, shard_width)
        shape = tuple(t.shape[:-1]) if shape_only else tuple(t.shape)
        code = zlib.crc32(f"{name}{shape}{t.dtype}".encode(), code)
        if not shape_only and t.numel() and t.device.type != "meta" and t.layout == torch.strided:
            flat = t.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // SAMPLES)][:SAMPLES]
            pieces.append(sample.contiguous().view(torch.uint8))
    if not pieces:
        return None if code == 0 else torch.tensor([code, code], dtype=torch.int64)
    raw = torch.cat(pieces).to(torch.int64)  # (L,) bytes of every sample, in argument order
    weights = _weights(raw.device, raw.numel())
    # (2, L) @ bytes: < 2**39 per term, L <= 4096 terms: no int64 overflow.
    return ((weights[:, :raw.numel()] * raw).sum(1) + code) % _PRIME


def _weights(device: torch.device, n: int) -> torch.Tensor:
    """(2, >=n) fixed pseudo-random int64 weights in [1, 2**31), the same on every rank."""
    w = _WEIGHTS.get(device)
    if w is None or w.shape[1] < n:
        gen = torch.Generator().manual_seed(20)
        w = torch.randint(1, _PRIME, (2, max(n, 4 * SAMPLES)), generator=gen,
                          dtype=torch.int64).to(device)
        _WEIGHTS[device] = w
    return w


def _encoded(digest: torch.Tensor | None) -> torch.Tensor | None:
    """``(2 * _BYTES,)`` float64: the digest's bytes ``b`` then ``b * b`` (exact integers)."""
    if digest is None:
        return None
    shifts = torch.arange(0, 32, 8, device=digest.device)
    b = ((digest[:, None] >> shifts) & 255).reshape(-1).to(torch.float64)  # (_BYTES,)
    return torch.cat([b, b * b])


def _verdict(fwd: _Forward, group: ProcessGroup, shard_width: int | None) -> None:
    """Raise :class:`RankMismatchError` on every rank if the ranks' digests differ."""
    sums = _comm.ride_result(group, fwd.ride)  # (2 * _BYTES,) float64, summed over the group
    size = dist.get_world_size(group)
    s, q = sums[:_BYTES], sums[_BYTES:]
    if torch.equal(size * q, s * s):
        return
    mine = {name: _detail(t, shard_width) for name, t in _checked(fwd.args, fwd.kwargs)}
    everyone: list[Any] = [None] * size
    dist.all_gather_object(everyone, mine, group=group)
    raise_different_inputs(everyone, "every forward")


def _detail(t: torch.Tensor, shard_width: int | None) -> str:
    if _shape_only(t, shard_width):
        return f"shape {tuple(t.shape[:-1])} (+ this rank's input shard)"
    return f"{tuple(t.shape)} {tensor_digest(t)}"
