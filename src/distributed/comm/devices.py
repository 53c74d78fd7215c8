"""Which device a rank computes on, and whether its group can communicate there.

Defaults follow the process group: under NCCL :func:`init_tensor_parallel`
binds the process to ``cuda:LOCAL_RANK`` and that is where layers, loads and
the CLI put tensors; under Gloo it is the CPU. An explicit ``device=`` always
wins. A model whose parameters live where the group's backend cannot
communicate (CPU tensors under NCCL, CUDA tensors under a Gloo-only group) is
refused at wrap time, on every rank, instead of failing inside the first
collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .runtime import ProcessGroup, get_tensor_parallel_config

# Device types each backend moves tensors of. Gloo's CUDA support covers only
# some collectives, so CUDA tensors need NCCL (or "cpu:gloo,cuda:nccl").
_BACKEND_DEVICES = {"gloo": {"cpu"}, "nccl": {"cuda"}, "xccl": {"xpu"}}


def default_device(device: torch.device | str | None = None) -> torch.device:
    """``device`` if given, else this rank's device from :func:`get_tensor_parallel_config`.

    That is ``cuda:LOCAL_RANK`` (the current CUDA device) under NCCL and the CPU
    under Gloo or without a process group.
    """
    if device is not None:
        return torch.device(device)
    return get_tensor_parallel_config().device


def backend_devices(backend: str) -> set[str] | None:
    """Device types ``backend`` communicates, e.g. ``{"cpu", "cuda"}`` for ``"cpu:gloo,cuda:nccl"``.

    Returns ``None`` for backends torchtp does not know (mpi, ucc, custom):
    those are not checked.
    """
    if ":" not in backend:
        return _BACKEND_DEVICES.get(backend.lower())
    devices = set()
    for part in backend.split(","):
        device, _, _name = part.partition(":")
        devices.add(device.strip().lower())
    return devices


def group_backend(group: ProcessGroup | None) -> str:
    """The backend string of ``group`` (e.g. ``"nccl"`` or ``"cpu:gloo,cuda:nccl"``)."""
    return str(dist.get_backend(group))


def device_mismatch(model: nn.Module, group: ProcessGroup | None) -> ValueError | None:
    """A ValueError with the fix if ``model``'s parameters sit where ``group`` cannot communicate.

    Meta tensors are fine (they are materialised later, on the rank's device).
    """
    if group is None or dist.get_world_size(group) == 1:
        return None
    backend = group_backend(group)
    usable = backend_devices(backend)
    if usable is None:
        return None
    found = {t.device.type for t in (*model.parameters(), *model.buffers())} - {"meta"}
    wrong = sorted(found - usable)
    if not wrong:
        return None
    target = get_tensor_parallel_config().device
    return ValueError(
        f"DistributedModelWrapper: the model has parameters on {', '.join(wrong)}, but the "
        f"tensor-parallel group's backend {backend!r} communicates only "
        f"{', '.join(sorted(usable))} tensors; move the model first (model.to({str(target)!r}), "
        "this rank's device from torchtp.get_tensor_parallel_config().device), build it there, "
        "or start the group with a backend for that device (init_tensor_parallel(backend="
        "'cpu:gloo,cuda:nccl') serves both)")
