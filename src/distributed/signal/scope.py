"""Signal scopes: ``context``/``enter``/``exit``, copy-sharding and tensor factories.

Inside a scope, factories return DTensors sharded along the signal's axis on
the 1-D sub-grid of its workers; outside any scope they return plain tensors.
Inside a scope, plain tensors mixed with those DTensors act as replicated
(DTensor's implicit replication), so ``A @ B`` with a plain ``B`` runs.
Scopes are SPMD: every rank of the world enters the same signals in the same
order (the first use of a worker set builds its grid, which is collective).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

from ..core.torch_compat import implicit_replication
from ..shard import Grid
from .config import SignalConfig, get_config


@dataclass(frozen=True)
class _Frame:
    name: str
    config: SignalConfig
    backward: str | None
    replication: AbstractContextManager[None]  # plain tensors act as replicated DTensors


_STACK: list[_Frame] = []
_GRIDS: dict[tuple[int, ...], Grid] = {}


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _workers(name: str, cfg: SignalConfig) -> tuple[int, ...]:
    world = _world()
    workers = tuple(range(world)) if cfg.shard is None or cfg.shard.workers is None else (
        cfg.shard.workers)
    outside = [w for w in workers if w >= world]
    if outside:
        raise ValueError(f"signal {name!r} ({cfg.source}.shard.workers): workers {outside} are "
                         f"outside the world of {world} rank(s) (0..{world - 1}); launch more "
                         "ranks or change workers")
    return workers


def _check_backward(name: str, cfg: SignalConfig, backward: str | None) -> str | None:
    target = backward if backward is not None else cfg.backward_signal
    if target is None:
        return None
    bcfg = get_config(target)
    fwd_workers, bwd_workers = _workers(name, cfg), _workers(target, bcfg)
    if fwd_workers != bwd_workers:
        raise NotImplementedError(
            f"signal {name!r} runs forward on workers {list(fwd_workers)} but its backward "
            f"signal {target!r} uses workers {list(bwd_workers)}. torchtp computes gradients "
            "with torch autograd on the ranks that ran the forward; moving the backward to "
            "other ranks is pipeline parallelism (activations and gradients sent between "
            "stages on a schedule), which torchtp does not implement. Use the same workers "
            "for both, or split the model into stages yourself.")
    fwd_axis = None if cfg.shard is None else cfg.shard.axis
    bwd_axis = None if bcfg.shard is None else bcfg.shard.axis
    if fwd_axis != bwd_axis:
        raise NotImplementedError(
            f"signal {name!r} shards axis {fwd_axis} but its backward signal {target!r} "
            f"shards axis {bwd_axis}: gradients always have the placement of the tensors "
            "they belong to, so a different backward axis cannot be honoured")
    return target


def enter(name: str, backward: str | None = None) -> SignalConfig:
    """Enter the scope of signal ``name`` (pair with :func:`exit`).

    Raises:
        KeyError: unknown signal.
        ValueError: workers outside the world.
        NotImplementedError: the backward signal shards differently (see docs/signal.md).
    """
    cfg = get_config(name)
    _workers(name, cfg)
    frame = _Frame(name, cfg, _check_backward(name, cfg, backward), implicit_replication())
    frame.replication.__enter__()
    _STACK.append(frame)
    return cfg


def exit(name: str | None = None) -> None:
    """Leave the innermost scope (``name``, when given, must be that scope)."""
    if not _STACK:
        raise RuntimeError(f"signal.exit({name!r}) without a matching signal.enter")
    if name is not None and _STACK[-1].name != name:
        raise RuntimeError(f"signal.exit({name!r}) but the innermost signal is "
                           f"{_STACK[-1].name!r}; exit scopes in reverse order")
    _STACK.pop().replication.__exit__(None, None, None)


@contextmanager
def context(name: str, backward: str | None = None) -> Iterator[SignalConfig]:
    """``with signal.context(name):`` — shard tensors and compute as signal ``name`` says."""
    cfg = enter(name, backward)
    try:
        yield cfg
    finally:
        exit(name)


def current() -> str | None:
    """Name of the innermost active signal, or ``None``."""
    return _STACK[-1].name if _STACK else None


def grid_for(name: str) -> Grid | None:
    """The 1-D grid over signal ``name``'s workers (``None`` without a process group)."""
    cfg = get_config(name)
    workers = _workers(name, cfg)
    if _world() == 1:
        return None
    if workers not in _GRIDS:
        _GRIDS[workers] = Grid((len(workers),), ranks=workers, name=f"signal{len(_GRIDS)}")
    return _GRIDS[workers]


def _placement(name: str, cfg: SignalConfig, ndim: int, sharded: bool) -> Shard | Replicate:
    if cfg.shard is None or not sharded:
        return Replicate()
    if cfg.shard.axis >= ndim:
        raise ValueError(f"signal {name!r} ({cfg.source}.shard.axis) shards axis "
                         f"{cfg.shard.axis}, but the tensor has {ndim} dim(s)")
    return Shard(cfg.shard.axis)


def tensor(x: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Copy-shard ``x`` as signal ``name`` (default: the active one) says.

    The lowest-numbered worker's ``x`` is the source: it is scattered to the workers.
    """
    name = name if name is not None else current()
    if name is None:
        raise RuntimeError("signal.tensor(x) needs name=... outside a signal context")
    cfg = get_config(name)
    placement = _placement(name, cfg, x.dim(), True)
    grid = grid_for(name)
    if grid is None:
        return x.clone()
    return distribute_tensor(x.detach().clone(), grid.dtensor_mesh(), [placement],
                             src_data_rank=0)


def _factory(fill: Any, size: tuple[Any, ...], sharded: bool, **kw: Any) -> torch.Tensor:
    shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
    full = fill(shape, **kw)
    name = current()
    if name is None:
        return full
    cfg = _STACK[-1].config
    placement = _placement(name, cfg, len(shape), sharded)
    grid = grid_for(name)
    if grid is None:
        return full
    # Every rank draws the full tensor and keeps its piece: no communication,
    # and under one seed the shards are exactly torch's unsharded tensor.
    return distribute_tensor(full, grid.dtensor_mesh(), [placement], src_data_rank=None)


def randn(*size: Any, sharded: bool = True, **kw: Any) -> torch.Tensor:
    """``torch.randn`` sharded by the active signal (plain outside a scope)."""
    return _factory(torch.randn, size, sharded, **kw)


def zeros(*size: Any, sharded: bool = True, **kw: Any) -> torch.Tensor:
    """``torch.zeros`` sharded by the active signal (plain outside a scope)."""
    return _factory(torch.zeros, size, sharded, **kw)


def ones(*size: Any, sharded: bool = True, **kw: Any) -> torch.Tensor:
    """``torch.ones`` sharded by the active signal (plain outside a scope)."""
    return _factory(torch.ones, size, sharded, **kw)


def parallelize(module: nn.Module, name: str | None = None,
                compile_kwargs: dict[str, Any] | None = None) -> nn.Module:
    """Parallelize ``module`` under signal ``name`` (default: the active one).

    Parameters become DTensors replicated on the signal's workers, so sharded
    inputs run data-parallel; ``compile: true`` then wraps the module in
    ``torch.compile(module, **compile_kwargs)``.
    """
    name = name if name is not None else current()
    if name is None:
        raise RuntimeError("signal.parallelize(module) needs name=... outside a signal context")
    cfg = get_config(name)
    grid = grid_for(name)
    if grid is not None and grid.is_member and not any(
            isinstance(p, DTensor) for p in module.parameters()):
        module = distribute_module(module, grid.dtensor_mesh())
    if cfg.compile:
        # torch.compile of a module returns an OptimizedModule (an nn.Module).
        return cast(nn.Module, torch.compile(module, **(compile_kwargs or {})))
    return module
