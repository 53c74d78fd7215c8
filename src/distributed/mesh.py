"""The 2-D ``("dp", "tp")`` DeviceMesh behind ``init_tensor_parallel(tp_size=k)``.

TP groups are contiguous ranks (``[i*k, (i+1)*k)``) so tensor parallelism,
the chatty dimension, stays inside a node; DP groups are the strided ranks
``{j, j+k, j+2k, ...}``. Built with PyTorch's own ``init_device_mesh`` so
DDP (``process_group=cfg.dp_group``) and FSDP2 (``mesh=cfg.mesh["dp"]``)
compose with it directly.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def build_mesh(tp_size: int, device_type: str) -> DeviceMesh:
    """A ``(world/tp_size, tp_size)`` mesh named ``("dp", "tp")`` over the default group.

    Collective over the whole world (it creates one sub-group per row and
    column); every rank must call it with the same ``tp_size``.

    Raises:
        ValueError: ``tp_size`` does not divide the world size (names the valid values).
    """
    world = dist.get_world_size()
    if not isinstance(tp_size, int) or tp_size < 1 or world % tp_size:
        raise ValueError(f"init_tensor_parallel: tp_size={tp_size!r} must divide the world size "
                         f"{world}; valid tp_size values: "
                         f"{[n for n in range(1, world + 1) if world % n == 0]}")
    return init_device_mesh(device_type, (world // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
