"""TP-aware gradient norm and clipping.

``torch.nn.utils.clip_grad_norm_`` on a tensor-parallel model sees only this
rank's shards: every rank computes a different, too small norm and clips by a
different factor, so the replicated weights drift apart. Here each
parameter's contribution is weighted by how many ranks hold the same numbers
(from the layouts the wrapper attached, see :mod:`torchtp.core.layouts`):

* a split parameter (or a segment of one) held by one rank counts once;
* a KV-head segment replicated over ``k`` ranks counts ``1/k`` on each;
* a replicated parameter counts ``1/tp`` on each TP rank, ``1/(tp*dp)`` when
  data-parallel replicas hold it too;
* FSDP2's DTensor gradients count their local shard once (the DP ranks hold
  disjoint pieces).

One all-reduce (sum, or max for the inf-norm) over the TP group, or over the
world when there is data parallelism, gives every rank the same total, so
every rank applies the same clipping factor.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..comm import ops as _comm
from ..comm.group_ref import GroupRef
from ..comm.objects import all_gather_object
from ..comm.runtime import ProcessGroup, get_tensor_parallel_config, group_size
from ..core import torch_compat as _torch_compat
from ..core.layouts import ParamLayout
from ..layers import layouts_of

Params = torch.Tensor | Iterable[torch.Tensor] | nn.Module

# Wrapped models whose layouts describe their parameters, with the TP group each was split
# over (weak: models and groups die freely).
_MODELS: weakref.WeakKeyDictionary[nn.Module, GroupRef] = weakref.WeakKeyDictionary()
# module -> (its layouts dict (layouts_of), {attr: ranks holding each segment}); recomputed
# when the dict is replaced (loading, resharding).
_COUNTS: weakref.WeakKeyDictionary[nn.Module, tuple[object, dict[str, tuple[int, ...]]]] = (
    weakref.WeakKeyDictionary())


def track(model: nn.Module, group: ProcessGroup | None) -> None:
    """Record a wrapped model and its TP group so :func:`grad_norm` finds its parameters'
    layouts and group, and route ``torch.nn.utils.clip_grad_norm_`` for its parameters
    here (:func:`route_torch_clip`)."""
    _MODELS[model] = GroupRef(group, "torchtp's gradient clipping")
    route_torch_clip()


def holds_wrapped(params: list[torch.Tensor]) -> bool:
    """Whether ``params`` include a parameter of a tracked wrapped model (one pass over
    their parameters: a clip already passes over every gradient)."""
    wrapped = {id(p) for model in _MODELS for p in model.parameters()}
    return any(id(p) in wrapped for p in params)


def _group_of(params: list[torch.Tensor]) -> ProcessGroup | None:
    """The TP group the wrapped models holding ``params`` were split over, when they share
    one (a model wrapped with ``group=`` of its own); else ``None``."""
    wanted = {id(p) for p in params}
    groups = {id(g): g for model, ref in list(_MODELS.items())
              if any(id(p) in wanted for p in model.parameters()) and (g := ref()) is not None}
    return next(iter(groups.values())) if len(groups) == 1 else None


def route_torch_clip() -> None:
    """Make ``torch.nn.utils.clip_grad_norm_`` clip a wrapped model's parameters by the whole
    model's norm (:func:`clip_grad_norm_`); other parameters as before. Idempotent.

    Called at a wrap with tp > 1, never at import. accelerate's ``clip_grad_norm_``,
    Lightning's ``gradient_clip_val`` and users' own loops call torch's function, which
    on a tensor-parallel model sees only this rank's shards: where each rank's shards
    stay under ``max_norm`` but the whole model's norm does not, no rank clips, the
    replicated gradients stay equal, and no check could see the difference from one
    process. Routed, it returns what one process's call returns.
    """
    original = torch.nn.utils.clip_grad_norm_
    if getattr(original, "_torchtp", False):
        return

    @functools.wraps(original)
    def routed(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
               norm_type: float = 2.0, error_if_nonfinite: bool = False,
               foreach: bool | None = None) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        clip = clip_grad_norm_ if holds_wrapped(params) else original
        return clip(params, max_norm, norm_type, error_if_nonfinite, foreach)

    routed._torchtp = True  # type: ignore[attr-defined]
    # Both names: torch.nn.utils re-exports it, and the deprecated clip_grad_norm calls
    # the module's own
    torch.nn.utils.clip_grad_norm_ = routed
    torch.nn.utils.clip_grad.clip_grad_norm_ = routed


@dataclass(frozen=True)
class _Role:
    """Where a parameter's gradient numbers live: segments along ``dim`` and their owners."""

    layout: ParamLayout | None  # None: replicated on every TP rank
    holders: tuple[int, ...]  # TP ranks holding each segment (same order as layout.segments)


@torch.no_grad()  # like torch's clip: no graph, and DTensor.to_local() is a plain attribute read
def grad_norm(parameters: Params, norm_type: float | str = 2.0,
              group: ProcessGroup | None = None) -> torch.Tensor:
    """The norm of the whole (unsharded) model's gradient, the same on every rank.

    Equals ``torch.nn.utils.get_total_norm`` of the unsharded model's
    gradients. Collective over the TP group (the world with data parallelism).

    Args:
        parameters: A model, or its parameters (a tensor or an iterable); those
            of a :class:`~torchtp.DistributedModelWrapper` are recognised by
            their layouts, any other parameter counts as replicated.
        norm_type: ``p`` of the p-norm, or ``inf``.
        group: TP group; ``None``: the group the parameters' wrapped model was split over
            (``DistributedModelWrapper(..., group=...)``), else the default TP group.

    Returns:
        A 0-dim tensor on the gradients' device: float64 when a gradient is float64,
        else float32.

    Raises:
        ValueError: a DTensor gradient whose mesh is not the DP mesh, or whose
            TP segments are replicated unevenly (packed KV heads under FSDP2); a
            pipeline-parallel job (every rank holds one stage: the norm would be the
            stage's, so each stage would clip by another factor).
    """
    cfg = get_tensor_parallel_config()
    if cfg.pp_size > 1:
        raise ValueError(
            f"grad_norm / clip_grad_norm_ in a pipeline-parallel job (pp={cfg.pp_size}): this "
            f"rank holds stage {cfg.pp_rank} only, so the norm would be its stage's and each "
            "stage would clip by another factor; use PipelineSchedule.clip_grad_norm_("
            "max_norm), which sums the stages' shares")
    params = _with_grads(parameters)
    device = params[0].grad.device if params else torch.device("cpu")  # type: ignore[union-attr]
    if group is None:  # the group the parameters' model was split over, else the default
        group = _group_of(params)
    tp = group if group is not None else cfg.group
    # A generator of parameters is spent by now: pass the list (a module as itself).
    given = parameters if isinstance(parameters, nn.Module) else params
    local, reduce_over = local_norm_share(given, norm_type, tp, device)
    p = float(norm_type)
    if reduce_over is not None and group_size(reduce_over) > 1:
        local = _comm.all_reduce(local, reduce_over, "max" if math.isinf(p) else "sum")
    return local if math.isinf(p) else local ** (1.0 / p)


@torch.no_grad()
def local_norm_share(parameters: Params, norm_type: float | str, tp: ProcessGroup | None,
                     device: torch.device) -> tuple[torch.Tensor, ProcessGroup | None]:
    """This rank's share of ``sum |grad|^p`` (``max |grad|`` for inf) and the group to sum over.

    What :func:`grad_norm` reduces: summed over the returned group (the TP
    group ``tp``, ``None`` for none, or the world when ``init_parallel`` built a ``dp``
    dimension) it is the whole model's ``norm ** p``. The pipeline's clip sums
    it over its stages too. Local: no collective except, once per model, the
    count of which TP ranks hold each segment.

    Raises:
        ValueError: see :func:`grad_norm`.
    """
    params = _with_grads(parameters)
    cfg = get_tensor_parallel_config()
    p = float(norm_type)
    if not p > 0:
        raise ValueError(f"grad_norm: norm_type={norm_type!r} must be > 0 or inf")
    roles = _roles(params, parameters, tp)
    pieces: list[tuple[torch.Tensor, float]] = []
    for param in params:
        pieces += _weighted_pieces(param, roles.get(id(param)), group_size(tp), cfg.dp_size)
    return _local_sum(pieces, p, device), (dist.group.WORLD if cfg.dp_size > 1 else tp)


@torch.no_grad()
def clip_grad_norm_(parameters: Params, max_norm: float, norm_type: float | str = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """Clip gradients by the whole model's norm, as ``torch.nn.utils.clip_grad_norm_``
    does on the unsharded model; every rank applies the same factor.

    Args:
        parameters: A model, or its parameters (see :func:`grad_norm`).
        max_norm: Largest allowed norm.
        norm_type: ``p`` of the p-norm, or ``inf``.
        error_if_nonfinite: Raise (on every rank) if the total norm is nan/inf.
        foreach: Passed to ``torch.nn.utils.clip_grads_with_norm_``.

    Returns:
        The total norm before clipping (0-dim tensor, equal on every rank).

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the norm is not finite.
    """
    params = _with_grads(parameters)
    total = grad_norm(params if not isinstance(parameters, nn.Module) else parameters, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
            "non-finite (on every rank), so it cannot be clipped; set error_if_nonfinite=False "
            "to skip this check")
    if params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=foreach)
    return total


def _with_grads(parameters: Params) -> list[torch.Tensor]:
    if isinstance(parameters, nn.Module):
        parameters = parameters.parameters()
    elif isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    return [p for p in parameters if p.grad is not None]


def _weighted_pieces(param: torch.Tensor, role: _Role | None, tp_size: int,
                     dp_size: int) -> list[tuple[torch.Tensor, float]]:
    """``(local piece of the gradient, ranks holding the same numbers)`` for ``param``."""
    grad = param.grad
    assert grad is not None
    dp_weight = float(dp_size)
    if hasattr(grad, "to_local"):  # FSDP2: a DTensor sharded over the DP mesh
        grad, dp_weight = _dtensor_local(grad, role, dp_size)
    return [(piece, holders * dp_weight) for piece, holders in _segments(grad, role, tp_size)]


def _local_sum(pieces: list[tuple[torch.Tensor, float]], p: float,
               device: torch.device) -> torch.Tensor:
    """This rank's weighted share of ``sum |grad|^p`` (or ``max |grad|`` for inf): float64
    when a gradient is float64 (as torch's norm of float64 gradients), else float32.

    One ``_foreach_norm`` per dtype and device (as ``torch.nn.utils.get_total_norm``
    does), then one weighted sum: a handful of ops, not a few per parameter.
    """
    # An empty piece adds nothing (and has no inf norm: _foreach_norm raises on it).
    pieces = [(t, w) for t, w in pieces if t.numel()]
    acc = torch.float64 if any(t.dtype == torch.float64 for t, _ in pieces) else torch.float32
    if not pieces:
        return torch.zeros((), dtype=acc, device=device)
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, (piece, _) in enumerate(pieces):
        groups.setdefault((piece.dtype, piece.device), []).append(i)
    norms: list[torch.Tensor] = [torch.empty(0)] * len(pieces)
    for (dtype, _), members in groups.items():
        # float32 like vector_norm(x.float()); float64 in float64 (dtype= may not narrow)
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        for i, norm in zip(members, _torch_compat.foreach_norm(
                [pieces[i][0] for i in members], p, dtype=wide), strict=True):
            norms[i] = norm.to(device, acc)
    stacked = torch.stack(norms)  # (pieces,)
    if math.isinf(p):
        return stacked.max()
    weights = torch.tensor([w for _, w in pieces], dtype=acc, device=device)
    return (stacked ** p / weights).sum()


def _segments(grad: torch.Tensor, role: _Role | None,
              tp_size: int) -> list[tuple[torch.Tensor, int]]:
    """``(local piece, TP ranks holding it)`` for each segment of the local gradient."""
    if role is None or role.layout is None or role.layout.dim is None:
        return [(grad, tp_size)]
    if len(set(role.holders)) == 1:
        return [(grad, role.holders[0])]
    layout = role.layout
    assert layout.dim is not None
    dim = grad.dim() - 1 - layout.dim if layout.transposed else layout.dim
    out, start = [], 0
    for (_, n), holders in zip(layout.segments, role.holders, strict=True):
        out.append((grad.narrow(dim, start, n), holders))
        start += n
    return out


def _dtensor_local(grad: torch.Tensor, role: _Role | None,
                   dp_size: int) -> tuple[torch.Tensor, float]:
    """The local shard of an FSDP2 DTensor gradient and how many DP ranks hold it."""
    from torch.distributed.tensor import Replicate

    mesh = grad.device_mesh  # type: ignore[attr-defined]
    if mesh.size() != dp_size:
        raise ValueError(
            f"grad_norm: a DTensor gradient on a mesh of {mesh.size()} ranks, but the DP group "
            f"has {dp_size}; shard with fully_shard(..., mesh=cfg.mesh['dp']) so FSDP never "
            "spans TP peers")
    if role is not None and len(set(role.holders)) > 1:
        raise ValueError(
            "grad_norm: a parameter whose TP segments are replicated unevenly (packed QKV with "
            "replicated KV heads) cannot be weighted under FSDP2; use tp <= num_key_value_heads "
            "or split q/k/v projections")
    placements: tuple[object, ...] = grad.placements  # type: ignore[attr-defined]
    replicated = any(isinstance(pl, Replicate) for pl in placements)
    return grad.to_local(), float(dp_size if replicated else 1)  # type: ignore[attr-defined]


def _roles(params: list[torch.Tensor], parameters: Params,
           tp: ProcessGroup | None) -> dict[int, _Role]:
    """Role of every parameter of the tracked models (and of ``parameters`` if a module)."""
    models = list(_MODELS.keys()) + ([parameters] if isinstance(parameters, nn.Module) else [])
    wanted = {id(p) for p in params}
    modules: list[nn.Module] = []
    for model in models:
        for mod in model.modules():
            if layouts_of(mod) and any(id(p) in wanted for p in mod.parameters(recurse=False)):
                modules.append(mod)
    modules = list(dict.fromkeys(modules))
    _count_holders([m for m in modules if _cached(m) is None], tp)
    roles: dict[int, _Role] = {}
    for mod in modules:
        holders = _cached(mod) or {}
        for attr, param in mod.named_parameters(recurse=False):
            layout = layouts_of(mod).get(attr)
            if layout is not None and layout.dim is not None:
                roles[id(param)] = _Role(layout, holders[attr])
    return roles


def _cached(mod: nn.Module) -> dict[str, tuple[int, ...]] | None:
    entry = _COUNTS.get(mod)
    return entry[1] if entry is not None and entry[0] is layouts_of(mod) else None


def _count_holders(modules: list[nn.Module], tp: ProcessGroup | None) -> None:
    """For each split segment: how many TP ranks hold exactly it (one gather, then cached)."""
    if not modules:
        return
    # A segment is the same numbers on two ranks only with the same second cut (experts).
    mine = [{a: (lay.second, lay.segments) for a, lay in layouts_of(m).items()} for m in modules]
    everyone = [mine]
    size = group_size(tp)
    if size > 1:
        everyone = all_gather_object(mine, tp, "the clip's layout count")
    for i, mod in enumerate(modules):
        counts = {}
        for attr, (second, segments) in mine[i].items():
            counts[attr] = tuple(
                sum(1 for other in everyone
                    if other[i][attr][0] == second and seg in other[i][attr][1])
                for seg in segments)
        _COUNTS[mod] = (layouts_of(mod), counts)
