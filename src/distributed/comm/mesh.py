"""The one ``DeviceMesh`` with named dimensions behind :func:`torchtp.init_parallel`.

Every parallel dimension is a name in :data:`MESH_DIMS`, outermost first. The
innermost dimension varies fastest over global ranks, so ``tp`` groups are
contiguous ranks (``[i*k, (i+1)*k)``): tensor parallelism, the chattiest
dimension, stays inside a node. ``cp`` (context parallelism: the sequence
split over ranks, :mod:`torchtp.cp`) comes next, as in Megatron's
``tp-cp-ep-dp-pp`` order: its attention exchanges are the next chattiest.
``dp`` is strided over ``cp x tp`` blocks, and ``pp``, outermost, strides over
whole ``dp x cp x tp`` blocks: pipeline stages exchange only activations, so
they may sit on different nodes. ``dp`` or ``tp`` takes whatever the other
sizes leave (see :func:`mesh_sizes`); ``pp`` and ``cp`` are 1 unless given.
A new dimension is one more name here, not another code path: the mesh, its
validation and group lookup are generic over the names.

Built with PyTorch's own ``init_device_mesh`` so DDP
(``process_group=cfg.dp_group``) and FSDP2 (``mesh=cfg.mesh["dp"]``) compose
with it directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from math import prod

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..core import torch_compat as _torch_compat

MESH_DIMS: tuple[str, ...] = ("pp", "dp", "cp", "tp")
"""The dimensions torchtp builds, outermost (slowest over ranks) first."""

FILL_ORDER: tuple[str, ...] = ("tp", "dp")
"""Who takes the ranks the given sizes leave: ``tp`` when not given (the whole
world is one TP group by default), else ``dp``."""


def mesh_sizes(world: int, sizes: Mapping[str, int | None], who: str = "init_parallel",
               spelling: Mapping[str, str] | None = None) -> dict[str, int]:
    """Every dimension's size, in :data:`MESH_DIMS` order, for ``world`` ranks.

    Args:
        world: Number of ranks in the default group.
        sizes: The sizes given; ``None`` or missing means 1, except for the
            first of :data:`FILL_ORDER` not given, which takes what the others
            leave.
        who: The calling function, for messages.
        spelling: How the caller spells a dimension's argument (``{"tp": "tp_size"}``
            for ``init_tensor_parallel``); default the dimension's name.

    Raises:
        ValueError: an unknown dimension name, a size that is not a positive
            int, a size that does not divide ``world`` (naming the valid values),
            or sizes whose product does not equal ``world``.
    """
    spell = {n: n for n in MESH_DIMS} | dict(spelling or {})
    unknown = sorted(set(sizes) - set(MESH_DIMS))
    if unknown:
        raise ValueError(f"{who}: unknown mesh dimension(s) {unknown}; known: {list(MESH_DIMS)}")
    valid = [n for n in range(1, world + 1) if world % n == 0]
    for name, size in sizes.items():
        if size is None:
            continue
        if not isinstance(size, int) or isinstance(size, bool) or size < 1 or world % size:
            raise ValueError(f"{who}: {spell[name]}={size!r} must divide the world size {world}; "
                             f"valid {spell[name]} values: {valid}")
    fill = next((n for n in FILL_ORDER if sizes.get(n) is None), None)
    fixed = {n: sizes.get(n) or 1 for n in MESH_DIMS if n != fill}
    inner = prod(fixed.values())
    if world % inner or (fill is None and inner != world):
        shown = ", ".join(f"{spell[n]}={s}" for n, s in sizes.items() if s is not None)
        raise ValueError(f"{who}: {shown}: the product of the mesh sizes must equal the world "
                         f"size {world}; leave one of {[spell[n] for n in FILL_ORDER]} out to "
                         "take what the others leave")
    if fill is not None:
        fixed[fill] = world // inner
    return {n: fixed[n] for n in MESH_DIMS}


def build_mesh(sizes: Mapping[str, int | None], device_type: str, who: str = "init_parallel",
               spelling: Mapping[str, str] | None = None) -> DeviceMesh:
    """A mesh over the default group with every dimension of :data:`MESH_DIMS` named.

    Collective over the whole world (it creates one sub-group per row and
    column of each dimension); every rank must call it with the same sizes.

    Raises:
        ValueError: see :func:`mesh_sizes`; raised on every rank alike, before
            any group is created.
    """
    shape = mesh_sizes(dist.get_world_size(), sizes, who, spelling)
    mesh = init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))
    _torch_compat.hold_mesh_groups_weakly(mesh)  # a kept mesh must not keep its groups alive
    return mesh
