"""``Grid``: a named N-dimensional process grid (the dialect's ``shard.grid``).

A grid lays ``prod(shape)`` ranks out row-major on ``shape``. It covers the
whole world or a subset of it (``Grid((3,), ranks=[0, 1, 2])`` in a world of
4). With a process group running it builds a torch ``DeviceMesh`` and one
process group per set of grid axes; building it is then collective: every
rank of the world constructs the same grid, in the same order, members or
not. Without processes (or with ``init=False``) it is a pure shape, and the
index helpers work from explicit device multi-indices, which is how the
dialect's ``10x20x30`` examples run as plain unit tests.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..comm.group_ref import GroupRef
from ..comm.runtime import ProcessGroup
from ..core import torch_compat as _torch_compat
from . import _index
from ._index import Shape


def _running() -> bool:
    return dist.is_available() and dist.is_initialized()


class Grid:
    """A process grid of ``shape`` over ``ranks`` (row-major).

    Args:
        shape: Grid axis sizes, e.g. ``(2, 2)`` or ``(3,)``.
        ranks: Global ranks laid out row-major on the grid; ``None`` means
            ``0..prod(shape)-1``.
        name: The grid's symbol name (``@grid0`` in the dialect).
        device_type: DeviceMesh device type; ``None`` picks ``"cuda"`` under
            NCCL and ``"cpu"`` otherwise.
        init: Build the DeviceMesh and process groups when a process group
            is running; ``False`` keeps a pure shape for index arithmetic.

    Raises:
        ValueError: bad shape, ranks of the wrong count, repeated or outside the world.
    """

    def __init__(self, shape: Sequence[int], ranks: Sequence[int] | None = None, *,
                 name: str = "grid0", device_type: str | None = None, init: bool = True):
        self.shape: Shape = _index.check_shape(shape)
        self.name = name
        self.ranks: tuple[int, ...] = self._check_ranks(ranks)
        self.mesh: DeviceMesh | None = None
        # held weakly (comm.group_ref): the grid never keeps a destroyed group alive
        self._groups: dict[tuple[int, ...], GroupRef] = {}
        if init and _running():
            self._build(device_type)

    def _check_ranks(self, ranks: Sequence[int] | None) -> tuple[int, ...]:
        size = math.prod(self.shape)
        out = tuple(range(size)) if ranks is None else tuple(int(r) for r in ranks)
        if len(out) != size:
            raise ValueError(f"Grid {self.name} shape {self.shape} has {size} devices but "
                             f"ranks={list(out)} lists {len(out)}; pass exactly {size} ranks")
        if len(set(out)) != len(out):
            raise ValueError(f"Grid {self.name}: ranks={list(out)} repeats a rank")
        world = dist.get_world_size() if _running() else None
        if world is not None and any(not 0 <= r < world for r in out):
            raise ValueError(f"Grid {self.name}: ranks={list(out)} go outside the world of "
                             f"{world} ranks; use ranks in 0..{world - 1}")
        return out

    def _build(self, device_type: str | None) -> None:
        if device_type is None:
            device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
        layout = torch.tensor(self.ranks, dtype=torch.int64).reshape(self.shape)
        names = tuple(f"{self.name}_axis{i}" for i in range(self.ndim))
        self.mesh = DeviceMesh(device_type, layout, mesh_dim_names=names)
        _torch_compat.hold_mesh_groups_weakly(self.mesh)  # the grid must not keep groups alive
        # Groups over several axes: new_group is collective over the whole
        # world, so every rank creates every group here, in the same order.
        for n in range(2, self.ndim + 1):
            for axes in itertools.combinations(range(self.ndim), n):
                self._make_groups(axes)

    def _make_groups(self, axes: tuple[int, ...]) -> None:
        others = [a for a in range(self.ndim) if a not in axes]
        for fixed in itertools.product(*(range(self.shape[a]) for a in others)):
            device = [0] * self.ndim
            for a, c in zip(others, fixed, strict=True):
                device[a] = c
            members = [self.ranks[i] for i in _index.group_members(self.shape, device, axes)]
            group = dist.new_group(sorted(members))
            if dist.get_rank() in members:
                self._groups[axes] = GroupRef(group, f"Grid {self.name}")

    # -- shape ------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        """Number of grid axes."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of devices in the grid."""
        return math.prod(self.shape)

    @property
    def is_member(self) -> bool:
        """Whether this process is one of the grid's devices."""
        if not _running():
            return self.size == 1
        return dist.get_rank() in self.ranks

    def __repr__(self) -> str:
        return f"Grid(@{self.name}, shape={self.shape}, ranks={list(self.ranks)})"

    def grid_shape(self, axes: Sequence[int] | None = None) -> Shape:
        """Sizes of grid ``axes`` (all axes when ``None``) — ``shard.grid_shape``."""
        return _index.sub_shape(self.shape, _index.check_axes(axes, self.ndim, "axes"))

    # -- this process -----------------------------------------------------------
    def _my_linear(self) -> int:
        if not _running():
            if self.size == 1:
                return 0
            raise RuntimeError(f"{self!r} has no processes (torch.distributed is not "
                               "initialized); pass device=(...) to the index helpers")
        rank = dist.get_rank()
        if rank not in self.ranks:
            raise RuntimeError(f"rank {rank} is not a device of {self!r}; call grid ops only "
                               "on member ranks (check grid.is_member)")
        return self.ranks.index(rank)

    def process_linear_index(self, device: Sequence[int] | None = None) -> int:
        """Row-major linear index of ``device`` (this process when ``None``)."""
        if device is None:
            return self._my_linear()
        return _index.linear_index(device, self.shape)

    def process_multi_index(self, axes: Sequence[int] | None = None, *,
                            device: int | Sequence[int] | None = None) -> Shape:
        """Multi-index of this process (or ``device``) on ``axes`` (all when ``None``).

        Args:
            axes: Grid axes to report, in this order.
            device: A linear index or a full multi-index instead of this process.
        """
        picked = _index.check_axes(axes, self.ndim, "axes")
        if device is None:
            device = self._my_linear()
        full = _index.multi_index(device, self.shape) if isinstance(device, int) else (
            tuple(device))
        _index.linear_index(full, self.shape)
        return _index.in_group_index(full, picked)

    def neighbors_linear_indices(self, device: Sequence[int],
                                 split_axes: Sequence[int]) -> tuple[int, int]:
        """Linear indices of the previous and next device along ``split_axes`` (-1: none)."""
        return _index.neighbors(self.shape, device, split_axes)

    # -- groups -----------------------------------------------------------------
    def dtensor_mesh(self) -> DeviceMesh:
        """The grid's ``DeviceMesh``, for DTensors (``shard.distribute``, signals).

        torch orders each mesh dimension's process group by global rank, and DTensor's
        collectives place pieces in that order, while the mesh puts them at the grid
        coordinates: the two agree only where the ranks increase along every axis.

        Raises:
            RuntimeError: the grid has no mesh (no process group when it was built).
            ValueError: the ranks decrease along some axis (``ranks=[1, 0]``), where
                DTensor's ``full_tensor()`` would come back permuted.
        """
        if self.mesh is None:
            raise RuntimeError(f"{self!r} has no DeviceMesh; build it after init_process_group")
        layout = torch.tensor(self.ranks).reshape(self.shape)
        for axis in range(self.ndim):
            if not bool((layout.diff(dim=axis) > 0).all()):
                raise ValueError(
                    f"{self!r}: its ranks decrease along axis {axis}, so DTensor collectives "
                    "(which order each axis's group by global rank) would place pieces "
                    "elsewhere than the grid does; list the ranks increasing along every axis "
                    "for DTensor operations (the grid's own collectives take any order)")
        return self.mesh

    def rank_of(self, device: Sequence[int]) -> int:
        """Global rank of the device at multi-index ``device``."""
        return self.ranks[_index.linear_index(device, self.shape)]

    def members(self, axes: Sequence[int], device: Sequence[int] | None = None) -> list[int]:
        """Global ranks of the group along ``axes``, in in-group (row-major) order."""
        if device is None:
            device = self.process_multi_index()
        return [self.ranks[i] for i in _index.group_members(self.shape, device, axes)]

    def group(self, axes: Sequence[int]) -> ProcessGroup:
        """This process's group along ``axes`` (its ranks are sorted global ranks).

        Raises:
            RuntimeError: the grid has no processes or this rank is not a member.
        """
        self._my_linear()
        if self.mesh is None:
            raise RuntimeError(f"{self!r} was built with init=False or before "
                               "torch.distributed was initialized; rebuild it on every rank "
                               "after init_process_group")
        key = tuple(sorted(axes))
        if len(key) == 1:
            return self.mesh.get_group(key[0])
        group = self._groups[key]()
        assert group is not None  # built from a running group
        return group


def check_root(root: int | Sequence[int], group_shape: Shape, what: str,
               axes: Sequence[int]) -> Shape:
    """Validate an in-group multi-index (an int is allowed for one-axis groups)."""
    index = (root,) if isinstance(root, int) else tuple(int(r) for r in root)
    if len(index) != len(group_shape) or any(
            not 0 <= r < s for r, s in zip(index, group_shape, strict=False)):
        raise ValueError(f"{what}={list(index)} is not an in-group multi-index of the group "
                         f"along grid_axes={list(axes)} of shape {group_shape}; give "
                         f"{len(group_shape)} entries with 0 <= {what}[i] < {list(group_shape)}[i]")
    return index
