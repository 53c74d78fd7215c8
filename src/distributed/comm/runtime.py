"""Process-group set-up for tensor parallelism.

``init_tensor_parallel`` reads torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), starts the default process group and
records a :class:`TensorParallelConfig`. Without torchrun's environment it
returns a world-size-1 config and starts nothing, so the same script runs on
one device unchanged. With ``tp_size=k`` the world becomes a 2-D
``DeviceMesh`` ``("dp", "tp")`` (see :mod:`torchtp.comm.mesh`). :func:`tp_group` is
the one place that answers "which group is the TP group".
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from datetime import timedelta
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..core.errors import MissingProcessGroupError, launch_hint
from ..core.log import configure_from_env, logger
from . import health as _health
from .group_ref import WeakGroup, groups_alive
from .timeout import collective_timeout, set_collective_timeout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from .layout_file import Layout

ProcessGroup = dist.ProcessGroup


@dataclass(frozen=True)
class TensorParallelConfig:
    """Where this process sits in the tensor-parallel (and data-parallel) groups.

    ``world_size``, ``rank`` and ``group`` always mean the **TP group** (the
    whole world unless ``init_tensor_parallel(tp_size=k)`` made a 2-D mesh).

    Attributes:
        world_size: Number of ranks in the tensor-parallel group.
        rank: This process's rank in that group.
        local_rank: Rank on this node (selects the CUDA device).
        backend: ``"nccl"``, ``"gloo"``, or ``None`` when no process group exists.
        device: Device this rank computes on.
        group: The TP process group, or ``None`` for a single process.
        dp_size: Number of data-parallel replicas (TP groups); 1 without a mesh.
        dp_rank: This process's rank in its DP group (which replica it is).
        dp_group: The DP group (same TP rank in every replica), or ``None``
            when ``dp_size == 1``.
        mesh: The ``DeviceMesh`` of shape ``(pp_size, dp_size, cp_size, tp_size)``
            with dim names ``("pp", "dp", "cp", "tp")``, or ``None`` when no size
            was given.
        ep_size: How many blocks the experts of a mixture-of-experts model are
            shared out over inside each TP group (``init_parallel(ep=...)``);
            the default of ``DistributedModelWrapper(expert_parallel=...)``.
            1: every expert's features split over the whole TP group.
        pp_size: Pipeline stages (``init_parallel(pp=...)``); 1 without a mesh.
        pp_rank: This process's stage: its rank in its pipeline group.
        pp_group: The pipeline group (same ``dp`` and ``tp`` rank on every
            stage), or ``None`` when ``pp_size == 1``.
        cp_size: Context-parallel ranks (``init_parallel(cp=...)``): each holds
            ``1/cp_size`` of every sequence (:mod:`torchtp.cp`); 1 without a mesh.
        cp_rank: This process's rank in its context-parallel group.
        cp_group: The context-parallel group (same ``pp``, ``dp`` and ``tp``
            rank), or ``None`` when ``cp_size == 1``.
    """

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    backend: str | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # The groups are held weakly (comm.group_ref): a config never keeps a group alive.
    group: WeakGroup[ProcessGroup | None] = WeakGroup()
    dp_size: int = 1
    dp_rank: int = 0
    dp_group: WeakGroup[ProcessGroup | None] = WeakGroup()
    mesh: DeviceMesh | None = None
    ep_size: int = 1
    pp_size: int = 1
    pp_rank: int = 0
    pp_group: WeakGroup[ProcessGroup | None] = WeakGroup()
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: WeakGroup[ProcessGroup | None] = WeakGroup()


_CONFIG: TensorParallelConfig | None = None

EXIT_WAIT_S = 60.0  # at most this long (or TP_TIMEOUT if shorter) at exit for the other ranks


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _pick_backend(backend: str | None) -> str:
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo", "mpi", "ucc", "xccl", "cpu:gloo,cuda:nccl"):
        raise ValueError(f"unknown backend {backend!r}; use 'nccl' (GPUs) or 'gloo' (CPU)")
    if "nccl" in backend and not torch.cuda.is_available():
        # The reference guide's scripts say backend="nccl"; on a CPU-only machine
        # they should still run (on Gloo) rather than fail at start-up.
        logger.warning("backend=%r asked for, but CUDA is not available: using 'gloo'", backend)
        return "gloo"
    return backend


def _config_from_group(local_rank: int) -> TensorParallelConfig:
    backend = dist.get_backend()
    on_cuda = "nccl" in str(backend) and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    return TensorParallelConfig(
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        local_rank=local_rank,
        backend=str(backend),
        device=device,
        group=dist.group.WORLD,
    )


def _with_mesh(base: TensorParallelConfig, sizes: dict[str, int | None], who: str,
               spelling: dict[str, str]) -> TensorParallelConfig:
    """``base`` (whole world = TP) laid out as the named mesh when any size is given."""
    if all(v is None for v in sizes.values()):
        return base
    from .mesh import build_mesh

    m = build_mesh(sizes, base.device.type, who, spelling)
    def group(n: str) -> ProcessGroup | None:
        return m.get_group(n) if m[n].size() > 1 else None

    return replace(base, world_size=m["tp"].size(), rank=m.get_local_rank("tp"),
                   group=m.get_group("tp"), mesh=m,
                   dp_size=m["dp"].size(), dp_rank=m.get_local_rank("dp"), dp_group=group("dp"),
                   pp_size=m["pp"].size(), pp_rank=m.get_local_rank("pp"), pp_group=group("pp"),
                   cp_size=m["cp"].size(), cp_rank=m.get_local_rank("cp"), cp_group=group("cp"))


def _adopt(local_rank: int, sizes: dict[str, int | None], who: str,
           spelling: dict[str, str]) -> TensorParallelConfig:
    """The config of the running default group; an existing mesh of the same sizes is reused."""
    if (_CONFIG is not None and groups_alive(_CONFIG) and _CONFIG.mesh is not None
            and _CONFIG.group is not None
            and all(v in (None, _CONFIG.mesh[n].size()) for n, v in sizes.items())):
        return _CONFIG
    return _with_mesh(_config_from_group(local_rank), sizes, who, spelling)


def init_parallel(
    *, tp: int | None = None, dp: int | None = None, ep: int | None = None,
    pp: int | None = None, cp: int | None = None, layout: Any = None,
    backend: str | None = None, timeout: float | timedelta | None = None,
) -> TensorParallelConfig:
    """Start (or adopt) the default process group laid out as one named mesh.

    Idempotent: a second call, or a call after the user started the process
    group themselves, returns the config of the existing group.

    The world of ``W`` ranks becomes a ``DeviceMesh`` with the dimensions of
    :data:`torchtp.comm.mesh.MESH_DIMS` (``("pp", "dp", "cp", "tp")``): ``tp``
    groups are the contiguous ranks ``[i*tp, (i+1)*tp)`` (TP stays inside a
    node), ``cp`` groups stride by ``tp``, ``dp`` groups stride over
    ``cp x tp`` blocks inside each pipeline stage's block of ``W / pp`` ranks,
    ``pp`` groups stride over those blocks, and ``dp`` defaults to what the
    others leave (``W / (pp * cp * tp)``). With no size
    given the whole world is one TP group and no mesh is built. Every
    component then asks :func:`resolve_group` for its group by dimension
    name. Collective: every rank must call it with the same sizes.

    Args:
        tp: Ranks per tensor-parallel group; ``None``: the whole world (or
            ``W / dp`` when ``dp`` is given).
        dp: Data-parallel replicas; ``None``: what ``tp`` leaves.
        ep: Expert parallelism folded into each TP group (Megatron's "parallel
            folding": the same ranks, grouped differently for the experts):
            the experts of an MoE model are shared out over ``ep`` blocks of
            ``tp / ep`` consecutive ranks, each expert's features split inside
            its block. Must divide ``tp``; ``None`` or 1: every expert's
            features over the whole TP group. Recorded as ``cfg.ep_size``, the
            default of ``DistributedModelWrapper(expert_parallel=...)``; dense
            layers are unaffected (docs/moe.md).
        pp: Pipeline stages (outermost: stages exchange only activations, so
            they may span nodes); ``None``: 1. ``cfg.pp_rank`` is this rank's
            stage and ``cfg.pp_group`` the default group of
            :class:`torchtp.pipeline.PipelineSchedule` (docs/pipeline.md).
        cp: Context-parallel ranks: each holds ``1/cp`` of every sequence and
            attention runs across them (:class:`torchtp.cp.ContextParallel`,
            docs/context_parallel.md); ``None``: 1. ``cfg.cp_group`` is its group.
        backend: ``"nccl"``, ``"gloo"`` or ``"cpu:gloo,cuda:nccl"`` (both: CPU
            tensors over Gloo, CUDA tensors over NCCL); ``None`` picks ``nccl``
            when CUDA is available and ``gloo`` otherwise. A backend with NCCL
            but no CUDA falls back to ``gloo`` with a warning, so GPU scripts
            also run on CPU machines. With NCCL this rank's device is
            ``cuda:LOCAL_RANK``, and torchtp's defaults (layers, loads, CLI)
            put tensors there.
        layout: A layout file written by ``torchtp plan MODEL --gpus N --out FILE``
            (or its :class:`~torchtp.comm.layout_file.Layout`): its sizes are
            the mesh's. A job whose world size differs from the plan's, or a
            size given beside it that differs, is refused with the difference
            named, before any group is laid out.
        timeout: Collective timeout in seconds (or a ``timedelta``) of the group
            started here and of torchtp's own waits; ``None`` uses ``TP_TIMEOUT``
            or :data:`torchtp.comm.timeout.DEFAULT_TIMEOUT_S` (5 minutes).

    Returns:
        The :class:`TensorParallelConfig` for this process (``cfg.mesh`` holds
        every named dimension).

    Raises:
        ValueError: torchrun's variables are malformed or inconsistent, or the
            sizes do not multiply to the world size (naming the valid values),
            or the job does not match ``layout``, on every rank before any
            group is created.
    """
    sizes: dict[str, int | None] = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
    planned = None
    if layout is not None:
        planned, sizes, ep = _planned(layout, sizes, ep)
    cfg = _init(sizes, backend, timeout, "init_parallel", {}, ep)
    if planned is not None:
        _check_planned(planned, cfg)
    return cfg


def _planned(layout: Any, given: dict[str, int | None], ep: int | None
             ) -> tuple[Layout, dict[str, int | None], int]:
    """The planned layout, its mesh sizes and ep; refused where the job cannot match it."""
    from .layout_file import differences, read_layout  # only when a layout is given

    planned = read_layout(layout)
    clash = [f"{k}={v} given, the layout plans {k} {planned.sizes()[k]}"
             for k, v in (given | {"ep": ep}).items()
             if v is not None and v != planned.sizes()[k]]
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() \
        else _env_int("WORLD_SIZE", 1)
    problems = clash + differences(planned, world, {})
    if problems:
        raise ValueError(f"init_parallel: this job does not match layout={_layout_name(layout)}: "
                         + "; ".join(problems) + f"; launch {planned.world} ranks (torchrun "
                         f"--nproc-per-node ... --nnodes ...) or plan again for {world}")
    sizes = {k: v for k, v in planned.sizes().items() if k != "ep"}
    return planned, dict(sizes), planned.ep


def _check_planned(planned: Layout, cfg: TensorParallelConfig) -> None:
    """Refuse a group laid out other than ``planned`` (an adopted group's own mesh)."""
    from .layout_file import differences

    have = {"pp": cfg.pp_size, "dp": cfg.dp_size, "cp": cfg.cp_size, "tp": cfg.world_size,
            "ep": cfg.ep_size}
    world = dist.get_world_size() if dist.is_initialized() else 1
    problems = differences(planned, world, have)
    if problems:
        raise ValueError("init_parallel: the running group does not match the planned layout: "
                         + "; ".join(problems))


def _layout_name(layout: Any) -> str:
    return repr(str(layout)) if isinstance(layout, (str, Path)) else type(layout).__name__


def init_tensor_parallel(
    backend: str | None = None, timeout: float | timedelta | None = None,
    tp_size: int | None = None,
) -> TensorParallelConfig:
    """Start (or adopt) the default process group and return the TP config.

    The reference guide's spelling of :func:`init_parallel`
    (``init_tensor_parallel(tp_size=k)`` is ``init_parallel(tp=k)``).
    Idempotent: a second call, or a call after the user started the process
    group themselves, returns the config of the existing group.

    With ``tp_size=k`` the world of ``W`` ranks becomes a ``DeviceMesh`` of
    shape ``(W/k, k)`` with dim names ``("dp", "tp")``: TP groups are the
    contiguous ranks ``[i*k, (i+1)*k)`` (TP stays inside a node), DP groups
    the strided ones. Collective: every rank must call it with the same
    ``tp_size``.

    Args:
        backend: As for :func:`init_parallel`.
        timeout: As for :func:`init_parallel`.
        tp_size: Ranks per TP group; ``None`` makes the whole world one TP
            group (no data parallelism).

    Returns:
        The :class:`TensorParallelConfig` for this process.

    Raises:
        ValueError: torchrun's variables are malformed or inconsistent, or the
            world size is not divisible by ``tp_size`` (naming the valid values).
    """
    return _init({"tp": tp_size}, backend, timeout, "init_tensor_parallel", {"tp": "tp_size"})


def _init(sizes: dict[str, int | None], backend: str | None,
          timeout: float | timedelta | None, who: str,
          spelling: dict[str, str], ep: int | None = None) -> TensorParallelConfig:
    """Start or adopt the default group and lay it out as the mesh of ``sizes``; record ``ep``."""
    global _CONFIG
    before = (_CONFIG.ep_size if _CONFIG is not None and groups_alive(_CONFIG)
              and _CONFIG.group is not None else 1)
    cfg = _start(sizes, backend, timeout, who, spelling, ep)
    # Validated by _start; a call without ep keeps the running group's (idempotent).
    ep_size = before if ep is None else ep
    _CONFIG = cfg if cfg.ep_size == ep_size else replace(cfg, ep_size=ep_size)
    return _CONFIG


def _start(sizes: dict[str, int | None], backend: str | None,
           timeout: float | timedelta | None, who: str,
           spelling: dict[str, str], ep: int | None) -> TensorParallelConfig:
    configure_from_env()
    if timeout is not None:
        set_collective_timeout(timeout.total_seconds() if isinstance(timeout, timedelta)
                               else float(timeout))
    local_rank = _env_int("LOCAL_RANK", 0)
    if dist.is_available() and dist.is_initialized():
        cfg = _adopt(local_rank, sizes, who, spelling)
        check_ep(ep, cfg.world_size, who)
        return cfg
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} and WORLD_SIZE={world_size} are inconsistent: "
                         "need 0 <= RANK < WORLD_SIZE")
    if world_size == 1:
        wanted = {n: v for n, v in sizes.items() if v not in (None, 1)}
        if wanted:
            shown = ", ".join(f"{spelling.get(n, n)}={v}" for n, v in wanted.items())
            one = ", ".join(f"{spelling.get(n, n)}=1" for n in wanted)
            raise ValueError(f"{shown} needs {prod(wanted.values())} ranks, but WORLD_SIZE=1; "
                             f"launch with torchrun --nproc-per-node {prod(wanted.values())} "
                             f"or use {one}")
        check_ep(ep, 1, who)
        logger.debug("%s: no torchrun environment, world_size=1", who)
        return TensorParallelConfig()
    chosen = _pick_backend(backend)
    if "nccl" in chosen:  # "nccl" or "cpu:gloo,cuda:nccl": this rank computes on its GPU
        torch.cuda.set_device(local_rank)
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=collective_timeout())}
    if any(v is not None for v in sizes.values()):
        from .mesh import mesh_sizes

        check_ep(ep, mesh_sizes(world_size, sizes, who, spelling)["tp"], who)  # before waiting
    else:
        check_ep(ep, world_size, who)
    dist.init_process_group(backend=chosen, rank=rank, world_size=world_size, **kwargs)
    # We started the group, so we end it at exit (see shutdown_tensor_parallel).
    _health.end_at_exit(shutdown_tensor_parallel)
    cfg = _with_mesh(_config_from_group(local_rank), sizes, who, spelling)
    logger.debug("%s: %s", who, cfg)
    return cfg


def check_ep(ep: int | None, tp: int, who: str = "init_parallel") -> None:
    """Raise unless ``ep`` (experts' blocks per TP group) divides the TP size ``tp``.

    Raises:
        ValueError: naming the valid ``ep`` values; the same verdict on every
            rank, before any process group is created.
    """
    if ep is None:
        return
    valid = [d for d in range(1, tp + 1) if tp % d == 0]
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1 or tp % ep:
        raise ValueError(f"{who}: ep={ep!r} must divide tp={tp} (the experts are shared out "
                         f"over ep blocks of each TP group's ranks); valid ep values: {valid}")


def shutdown_tensor_parallel() -> None:
    """End the default process group (if one is running), bounded in time.

    Registered at exit by :func:`init_tensor_parallel` when it started the
    group; call it yourself to end earlier. Safe to call more than once.

    On a normal exit every rank waits for the others (at most
    :data:`EXIT_WAIT_S` = 60 s, or :func:`collective_timeout` if shorter; less
    if a rank dies, gives up waiting or has ended the store meanwhile), then
    destroys the group. A process exiting on an exception, or whose group a
    failure left inconsistent, waits for nobody: the other ranks learn of the
    failure from the store (their error names this rank) or from the closed
    connection, and ``torchrun`` ends the job at once.
    """
    global _CONFIG
    running = dist.is_available() and dist.is_initialized()
    if running and _health.dying() is None and not _health.poisoned_groups():
        _health.exit_barrier(dist.group.WORLD, min(EXIT_WAIT_S, collective_timeout()))
        # Before the interpreter shuts down: a Gloo worker freeing a finished
        # collective after that point aborts the process (see _health._hold).
        _health.settle(_health.SETTLE_S)
        dist.destroy_process_group()
        _health.forget_all()
    else:
        # Exiting on an error, or the user destroyed the group already (its
        # worker may still hold torchtp's tensors).
        _health.release_collectives()
    _CONFIG = None


def get_tensor_parallel_config() -> TensorParallelConfig:
    """Return the current TP config.

    Before :func:`init_tensor_parallel` it describes the process group the user
    started (if any), else a single process.
    """
    running = dist.is_available() and dist.is_initialized()
    # A cached config is stale once a group was started or destroyed after it.
    if _CONFIG is not None and groups_alive(_CONFIG) and (_CONFIG.group is not None) == running:
        return _CONFIG
    if running:
        return _config_from_group(_env_int("LOCAL_RANK", 0))
    return TensorParallelConfig()


def tp_group() -> ProcessGroup | None:
    """The TP group: :func:`resolve_group` with no explicit group (see there)."""
    return resolve_group()


def resolve_group(group: ProcessGroup | None = None, dim: str = "tp") -> ProcessGroup | None:
    """The process group of mesh dimension ``dim``: the one answer for every component.

    ``group`` if given; else, when a process group is running, the mesh's
    group for ``dim`` from :func:`init_parallel` (``"tp"``: the whole world
    when no mesh was built; another dimension of size 1: ``None``); else
    ``None``, one process. The one rule for "no group": ``None`` means a
    single process, so nothing to communicate; wherever more ranks are
    expected and there is no group, it raises with the fix.

    Raises:
        MissingProcessGroupError: torchrun's environment says WORLD_SIZE > 1 but
            no process group was started, so a collective would silently do
            nothing.
        ValueError: ``dim`` is not a mesh dimension.
    """
    if group is not None:
        return group
    if dist.is_available() and dist.is_initialized():
        return _mesh_group(get_tensor_parallel_config(), dim)
    env_world = _env_int("WORLD_SIZE", 1)
    if env_world > 1:
        raise MissingProcessGroupError(
            f"WORLD_SIZE={env_world} but torch.distributed is not initialized; "
            + launch_hint(env_world)
        )
    return None


def _mesh_group(cfg: TensorParallelConfig, dim: str) -> ProcessGroup | None:
    from .mesh import MESH_DIMS

    if dim not in MESH_DIMS:
        raise ValueError(f"unknown mesh dimension {dim!r}; known: {list(MESH_DIMS)}")
    if dim == "tp":
        return cfg.group
    if cfg.mesh is None or cfg.mesh[dim].size() == 1:
        return None
    return cfg.mesh.get_group(dim)


def group_size(group: ProcessGroup | None) -> int:
    """Number of ranks in ``group`` (1 for ``None``)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank in ``group`` (0 for ``None``)."""
    return 0 if group is None else dist.get_rank(group)
