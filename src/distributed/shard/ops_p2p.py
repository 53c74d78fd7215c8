"""Point-to-point shard-dialect ops: send, recv, shift, update_halo."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..comm.runtime import ProcessGroup
from . import _common as c
from . import _index
from .grid import Grid


def send(x: torch.Tensor, grid: Grid, destination: int | Sequence[int], *,
         grid_axes: Sequence[int] | None = None) -> torch.Tensor:
    """Send ``x`` to ``destination`` (in-group multi-index) and return ``x`` (``shard.send``).

    Blocks until the destination posts the matching :func:`recv`.
    """
    x = c.check_tensor("send", x)
    grid, axes = c.check_grid("send", grid, grid_axes)
    g = c.group_info(grid, axes)
    k = g.root(destination, "destination")
    if k == g.index:
        raise ValueError(f"shard.send: destination={list(_in(g, k))} is this device; "
                         "send to another member of the group")
    c.record("send", x, g.pg)
    dist.send(x.contiguous(), dst=g.members[k], group=g.pg)
    return x


def recv(x: torch.Tensor, grid: Grid, source: int | Sequence[int] | None = None, *,
         grid_axes: Sequence[int] | None = None) -> torch.Tensor:
    """Receive a tensor shaped like ``x`` from ``source`` (``shard.recv``).

    ``x``'s contents are ignored; ``source=None`` receives from any member.
    Returns a fresh tensor.
    """
    x = c.check_tensor("recv", x)
    grid, axes = c.check_grid("recv", grid, grid_axes)
    g = c.group_info(grid, axes)
    src = None
    if source is not None:
        k = g.root(source, "source")
        if k == g.index:
            raise ValueError(f"shard.recv: source={list(_in(g, k))} is this device; receive "
                             "from another member of the group")
        src = g.members[k]
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    c.record("recv", out, g.pg)
    dist.recv(out, src=src, group=g.pg)
    return out


def _in(g: c.GroupInfo, k: int) -> tuple[int, ...]:
    return _index.multi_index(k, g.shape)


def shift(x: torch.Tensor, grid: Grid, shift_axis: int, offset: int, *,
          grid_axes: Sequence[int] | None = None, rotate: bool = False) -> torch.Tensor:
    """Move every device's ``x`` ``offset`` steps along grid axis ``shift_axis`` (``shard.shift``).

    The device at coordinate ``i`` on ``shift_axis`` receives the tensor of
    coordinate ``i - offset``. With ``rotate`` the coordinates wrap around;
    without it, devices with no source return zeros (the dialect's "undefined").

    Raises:
        ValueError: ``shift_axis`` is not one of ``grid_axes``.
    """
    x = c.check_tensor("shift", x)
    grid, axes = c.check_grid("shift", grid, grid_axes)
    if shift_axis not in axes:
        raise ValueError(f"shard.shift: shift_axis={shift_axis} must be one of "
                         f"grid_axes={list(axes)}; add it to grid_axes")
    if not isinstance(offset, int):
        raise TypeError(f"shard.shift: offset must be an int, got {type(offset).__name__}")
    g = c.group_info(grid, axes)
    device = grid.process_multi_index()
    n = grid.shape[shift_axis]
    dst, src = _peer(grid, device, shift_axis, offset, rotate), _peer(
        grid, device, shift_axis, -offset, rotate)
    out = torch.zeros_like(x, memory_format=torch.contiguous_format)
    if offset % n == 0 and (rotate or offset == 0):
        out.copy_(x)
        return out
    ops = []
    if dst is not None:
        ops.append(dist.P2POp(dist.isend, x.contiguous(), dst, group=g.pg))
    if src is not None:
        ops.append(dist.P2POp(dist.irecv, out, src, group=g.pg))
    if ops:
        c.record("shift", x, g.pg)
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return out


def _peer(grid: Grid, device: Sequence[int], axis: int, step: int, rotate: bool) -> int | None:
    coords = list(device)
    coords[axis] += step
    if rotate:
        coords[axis] %= grid.shape[axis]
    elif not 0 <= coords[axis] < grid.shape[axis]:
        return None
    return grid.rank_of(coords)


def update_halo(destination: torch.Tensor, grid: Grid, split_axes: Sequence[Sequence[int] | int],
                halo_sizes: Sequence[int]) -> torch.Tensor:
    """Refresh the halos of a local shard from its neighbours (``shard.update_halo``).

    ``destination`` is the local shard with halos (core plus ``lo``/``hi``
    elements per sharded dim); every device has the same halo sizes. For each
    sharded dim in order, the ``lo`` halo receives the previous device's last
    ``lo`` core elements and the ``hi`` halo the next device's first ``hi``;
    slabs span the other dims' halos too, so corners are filled after the
    later dims. Halos with no neighbour (grid edges) are kept.

    Args:
        destination: Local shard, halos included.
        grid: The process grid.
        split_axes: Per tensor dim, the grid axes it is split over (as in ``Sharding``).
        halo_sizes: Flattened ``[lo, hi]`` per sharded dim.

    Returns:
        A fresh tensor: ``destination`` with updated halos.
    """
    x = c.check_tensor("update_halo", destination)
    grid, _ = c.check_grid("update_halo", grid, None)
    dims = _halo_dims(x, grid, split_axes, halo_sizes)
    device = grid.process_multi_index()
    out = x.clone(memory_format=torch.contiguous_format)
    if grid.size == 1:
        return out
    for dim, axes, lo, hi in dims:
        down, up = grid.neighbors_linear_indices(device, axes)
        prev = None if down < 0 else grid.ranks[down]
        nxt = None if up < 0 else grid.ranks[up]
        _exchange(out, dim, lo, hi, prev, nxt, grid.group(tuple(range(grid.ndim))))
    return out


def _halo_dims(x: torch.Tensor, grid: Grid, split_axes: Sequence[Sequence[int] | int],
               halo_sizes: Sequence[int]) -> list[tuple[int, tuple[int, ...], int, int]]:
    axes = [(a,) if isinstance(a, int) else tuple(a) for a in split_axes]
    sharded = [d for d, a in enumerate(axes) if a]
    if len(axes) > x.dim() or len(halo_sizes) != 2 * len(sharded):
        raise ValueError(f"shard.update_halo: split_axes={[list(a) for a in axes]} and "
                         f"halo_sizes={list(halo_sizes)} do not fit a tensor of shape "
                         f"{tuple(x.shape)}: give at most {x.dim()} split_axes entries and 2 "
                         "halo sizes per sharded dim")
    out = []
    for k, d in enumerate(sharded):
        lo, hi = int(halo_sizes[2 * k]), int(halo_sizes[2 * k + 1])
        core = x.shape[d] - lo - hi
        if lo < 0 or hi < 0 or core < max(lo, hi):
            raise ValueError(f"shard.update_halo: dim {d} of size {x.shape[d]} with halos "
                             f"[{lo}, {hi}] leaves a core of {core}; halos must be >= 0 and "
                             "no larger than the core (neighbours only)")
        out.append((d, _index.check_axes(axes[d], grid.ndim, "split_axes"), lo, hi))
    return out


def _exchange(out: torch.Tensor, dim: int, lo: int, hi: int, prev: int | None,
              nxt: int | None, pg: ProcessGroup | None) -> None:
    size = out.shape[dim]
    ops, recvs = [], []
    # My first hi core elements fill prev's hi halo; my last lo fill next's lo halo.
    if prev is not None and hi:
        ops.append(dist.P2POp(dist.isend, out.narrow(dim, lo, hi).contiguous(), prev, group=pg))
    if nxt is not None and lo:
        ops.append(dist.P2POp(dist.isend, out.narrow(dim, size - hi - lo, lo).contiguous(), nxt,
                              group=pg))
    if prev is not None and lo:
        buf = torch.empty_like(out.narrow(dim, 0, lo), memory_format=torch.contiguous_format)
        ops.append(dist.P2POp(dist.irecv, buf, prev, group=pg))
        recvs.append((0, buf))
    if nxt is not None and hi:
        buf = torch.empty_like(out.narrow(dim, size - hi, hi),
                               memory_format=torch.contiguous_format)
        ops.append(dist.P2POp(dist.irecv, buf, nxt, group=pg))
        recvs.append((size - hi, buf))
    if ops:
        c.record("update_halo", out, pg)
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for start, buf in recvs:
        out.narrow(dim, start, buf.shape[dim]).copy_(buf)
