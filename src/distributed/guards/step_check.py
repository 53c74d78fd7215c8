"""Replicated state agreed across the TP group at every optimizer step.

Every TP rank holds its own copy of each replicated parameter (one that no
layout splits along any dimension: norms, most biases, a replicated
embedding, LoRA ``A`` of a row-split layer...). torchtp computes the same
gradient for it on every rank, so the copies stay equal, until something
changes one rank's copy alone: a clip by the norm of this rank's own shards
(torch's ``clip_grad_norm_`` bound before the first wrap, which the wrap could
not route to :func:`torchtp.clip_grad_norm_`: :mod:`torchtp.training.clip`), a
rank loading the wrong shard file, a rank-local edit. The copies then drift
apart and every later step is silently wrong.

So before each optimizer step (PyTorch's public optimizer step pre-hook,
registered once by the first wrap at ``tp > 1``, never at import) the
optimizers holding parameters of a wrapped model compare a digest of the
replicated parameters' gradients across the TP group, and every
``TP_STEP_CHECK`` steps (default 10, the first step always) a digest of the
replicated parameters themselves. Any difference raises
:class:`~torchtp.RankMismatchError` on every rank, before the step changes
any weight, naming the parameter and the likely cause.

The digest of one tensor is two numbers: its L2 norm over every element,
accumulated in float32 (a scaled tensor changes it; so does one element changed
by 1% wherever that moves a float32 norm: tensors up to ~10^5 elements of
similar size), and a float64 position-weighted sum of an evenly strided sample
of at most :data:`SAMPLES` elements (a permutation or sign flip among sampled
elements changes it).
Both come from a handful of fused ops for all parameters at once, and all
ranks compare them with ONE all-reduce (max of ``cat(d, -d)``: max equals
``-min`` where every rank sent the same value).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..comm import health
from ..comm import ops as _comm
from ..comm.group_ref import GroupRef, WeakGroup
from ..comm.runtime import ProcessGroup, group_size
from ..core import torch_compat as _torch_compat
from ..core.env import env_int
from ..core.errors import RankMismatchError
from ..core.log import logger
from ..layers import layouts_of

ENV = "TP_STEP_CHECK"
DEFAULT_PERIOD = 10
SAMPLES = 64  # elements per tensor in the position-weighted sample
# Relative slack when comparing digests: equal tensors give bitwise-equal digests under
# the same kernels and thread count, so any difference above float64 rounding of the
# (float64) comparison itself is a real one.
RTOL = 1e-12
_CAUSE_GRAD = (
    "a rank-local gradient change: a clip by the norm of each rank's own shards (torch's "
    "clip_grad_norm_ bound before the first wrap, as 'from torch.nn.utils import "
    "clip_grad_norm_' at import: call torch.nn.utils.clip_grad_norm_, which a wrap routes, "
    "or torchtp.clip_grad_norm_), or a DDP over the TP group that averaged or broadcast "
    "gradients")
CAUSE_WEIGHT = (
    "a wrong shard file or a rank-local edit on some ranks, or a DDP broadcast of one rank's "
    "weights into the others")
_CAUSE_PRESENCE = (
    "a gradient present on some TP ranks only: a backward, zero_grad or requires_grad change "
    "that ran on some ranks only")

# Wrapped models (weak) -> (TP group, held weakly; check period).
_MODELS: weakref.WeakKeyDictionary[nn.Module, tuple[GroupRef, int]] = (
    weakref.WeakKeyDictionary())
_GENERATION = [0]  # bumped by track(): cached optimizer plans are recomputed
_HOOK: list[object] = []  # the global hook's handle, once registered


@dataclass
class _Plan:
    """The replicated parameters of one optimizer that one TP group must agree on."""

    period: int
    names: list[str]
    params: list[torch.Tensor]
    group: WeakGroup[ProcessGroup] = WeakGroup(required=True)  # held weakly (comm.group_ref)
    steps: int = 0
    # Where the split-only plan's stand-in travels (no replicated parameter to digest)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # present-parameter indices -> (segment id per sampled element, its weight)
    layouts: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict)


# optimizer -> (cache key, its plans); weak: optimizers die freely.
_PLANS: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[tuple[object, ...], list[_Plan]]] \
    = weakref.WeakKeyDictionary()


def period_from_env() -> int:
    """Steps between weight checks from ``TP_STEP_CHECK`` (default 10; 0 turns the check off).

    Raises:
        ValueError: the variable is not an integer >= 0.
    """
    return env_int(ENV, DEFAULT_PERIOD, 0, "steps between weight checks; 0 turns the "
                   "optimizer-step check off")


def track(model: nn.Module, group: ProcessGroup | None) -> None:
    """Check ``model``'s replicated state at every step of an optimizer that holds it.

    Called by the wrapper. Registers the global optimizer step pre-hook on the
    first call at ``tp > 1``; a no-op at tp 1 or with ``TP_STEP_CHECK=0``.
    """
    period = period_from_env()
    if group is None or group_size(group) == 1:
        return
    if period == 0:
        logger.debug("%s=0: replicated state is not checked at optimizer steps", ENV)
        return
    _MODELS[model] = (GroupRef(group, "the optimizer-step check"), period)
    _GENERATION[0] += 1
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_before_step))


def _before_step(optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    if torch.compiler.is_compiling():
        return None  # a compiled step cannot run the eager collective; checked when run eagerly
    plans = _plans(optimizer)
    if not plans:
        return None
    # args is (optimizer, *step's positional arguments)
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    if closure is None:
        for plan in plans:
            check(plan)
        return None

    # step(closure) (Lightning's automatic optimization, LBFGS): the closure computes (and
    # Lightning clips) the gradients inside the step, so check after each call of it.
    def checked() -> Any:
        loss = closure()
        for plan in plans:
            check(plan)
        return loss

    if len(args) > 1:
        return (args[0], checked, *args[2:]), kwargs
    return args, {**kwargs, "closure": checked}


def _plans(optimizer: torch.optim.Optimizer) -> list[_Plan]:
    """The plans for ``optimizer``, cached until its parameter groups or the models change.

    A model whose group was destroyed is no longer checked (nothing can reach its peers).
    """
    gone = [model for model, (ref, _period) in list(_MODELS.items()) if not ref.alive]
    if gone:
        for model in gone:
            del _MODELS[model]
        _GENERATION[0] += 1
    key = (_GENERATION[0], *((id(g["params"]), len(g["params"])) for g in optimizer.param_groups))
    cached = _PLANS.get(optimizer)
    if cached is not None and cached[0] == key:
        return cached[1]
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    plans = [p for p in (_plan(model, held, *entry) for model, entry in list(_MODELS.items()))
             if p is not None]
    if not plans:  # logged once per change of its parameter groups, not per step
        logger.debug("optimizer step check: %s holds no replicated parameter of a wrapped "
                     "model; its steps are not checked", type(optimizer).__name__)
    _PLANS[optimizer] = (key, plans)
    return plans


def replicated_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every parameter of ``model`` that no layout splits: each TP
    rank holds its own copy, which must stay equal to the others'."""
    split = {id(p) for mod in model.modules() for attr, p in mod.named_parameters(recurse=False)
             if (lay := layouts_of(mod).get(attr)) is not None and lay.dim is not None}
    return [(n, p) for n, p in model.named_parameters() if id(p) not in split]


def _plan(model: nn.Module, held: set[int], ref: GroupRef, period: int) -> _Plan | None:
    """The replicated parameters of ``model`` that the optimizer holds (None: none of its own)."""
    group = ref()
    assert group is not None  # track() records groups of more than one rank only
    if not any(id(p) in held for p in model.parameters()):
        return None
    replicated = [(n, p) for n, p in replicated_parameters(model) if id(p) in held]
    if not replicated:  # nothing to compare, but the step itself must run on every rank
        logger.debug("optimizer step check: the optimizer holds only split parameters of %s",
                     type(model).__name__)
        device = next(p.device for p in model.parameters() if id(p) in held)
        return _Plan(period, [], [], group, device=device)
    return _Plan(period, [n for n, _ in replicated], [p for _, p in replicated], group)


@torch.no_grad()
def check(plan: _Plan) -> None:
    """Compare the digests of ``plan``'s replicated gradients (and weights) across its group.

    Collective over ``plan.group``: one all-reduce of ``16 * len(plan.params)`` float64.
    A digest that is not finite (a NaN or inf in one rank's copy) travels as a flag
    beside a finite stand-in: a maximum over NaN depends on the order the backend
    compares in, so the NaN itself would be lost on some ranks. Gradients that are not
    finite on some rank, at a step that does not check the weights, check them at
    once (a second all-reduce): one rank's NaN weight turns every rank's gradients NaN
    through the layers' all-reduces, and only the weights still tell the ranks apart.

    Raises:
        RankMismatchError: on every rank, naming the parameters that differ and the cause.
    """
    if not plan.params:  # split parameters only: a stand-in, so a step some ranks skip (a
        # GradScaler's, on a rank whose shards overflowed) meets another collective
        _comm.all_reduce_as(torch.zeros(2, dtype=torch.float64, device=plan.device),
                            plan.group, "max", health.STEP_CHECK)
        return
    with_weights = plan.steps % plan.period == 0
    plan.steps += 1
    grads = digest(plan, [p.grad for p in plan.params])
    weights = digest(plan, list(plan.params)) if with_weights else torch.zeros_like(grads)
    broken = _compare(plan, torch.cat([grads, weights]))
    if not with_weights and broken:
        _compare(plan, torch.cat([grads, digest(plan, list(plan.params))]))


def _compare(plan: _Plan, mine: torch.Tensor) -> bool:
    """One all-reduce of ``mine`` ``(4K,)`` (grad norms, grad samples, weight norms, weight
    samples) over ``plan.group``; raise where the ranks differ.

    Returns:
        Whether some rank's gradient digests are not finite (the same answer on every rank).
    """
    finite = mine.isfinite()
    # (8K,): the digests (non-finite ones as 0), then 0 where finite, 1 where not
    flagged = torch.cat([torch.where(finite, mine, 0.0), (~finite).to(mine.dtype)])
    both = _comm.all_reduce_as(torch.cat([flagged, -flagged]), plan.group, "max",
                               health.STEP_CHECK)
    high, low = both[:flagged.numel()], -both[flagged.numel():]
    bad = (high - low) > RTOL * torch.maximum(high.abs(), low.abs())
    count = mine.numel()
    nonfinite = set(bad[count:].nonzero().flatten().tolist())  # finite on some ranks only
    bad = bad[:count] | bad[count:]  # (4K,): a digest differs, or is finite on some ranks only
    if bool(bad.any()):
        raise _mismatch(plan, bad.nonzero().flatten().tolist(), high, low, nonfinite)
    return bool(high[count:count + count // 2].any())


def digest(plan: _Plan, tensors: list[torch.Tensor | None]) -> torch.Tensor:
    """``(2K,)`` float64: the L2 norms of ``tensors`` (-1 where None), then their sample sums."""
    count = len(tensors)
    held = [None if t is None else local(t) for t in tensors]
    present = tuple(i for i, t in enumerate(held) if t is not None and t.numel())
    chosen = [t for t in held if t is not None and t.numel()]
    device = next((t.device for t in held if t is not None), torch.device("cpu"))
    norms = torch.full((count,), -1.0, dtype=torch.float64, device=device)
    norms[[i for i, t in enumerate(held) if t is not None]] = 0.0  # empty tensors: 0
    sums = torch.zeros(count, dtype=torch.float64, device=device)
    if chosen:
        norms[torch.tensor(present, device=device)] = _norms(chosen, device)
        segment, weight = _layout(plan, present, chosen, device)
        sample = torch.cat([_sample(t).to(device) for t in chosen]).to(torch.float64)
        sums.index_add_(0, segment, sample * weight)
    return torch.cat([norms, sums])


def _norms(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``(len(tensors),)`` float64: each tensor's L2 norm, accumulated in float32 (float64
    tensors in float64): one ``_foreach_norm`` per dtype, as the clip computes them."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    out = torch.empty(len(tensors), dtype=torch.float64, device=device)
    for dtype, members in groups.items():
        # float64 accumulation of float32 data costs ~10x on CPU (a converted copy per tensor)
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        values = _torch_compat.foreach_norm([tensors[i] for i in members], 2.0, dtype=wide)
        out[torch.tensor(members, device=device)] = torch.stack(values).to(device, torch.float64)
    return out


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor of a parameter or gradient."""
    # FSDP2: TP peers hold the same DP shard of a replicated parameter; compare that.
    return t.to_local() if hasattr(t, "to_local") else t


def _sample(t: torch.Tensor) -> torch.Tensor:
    """At most SAMPLES elements of ``t``, evenly strided (a view when ``t`` is contiguous)."""
    flat = t.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // SAMPLES)][:SAMPLES]


def _layout(plan: _Plan, present: tuple[int, ...], chosen: list[torch.Tensor],
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sampled element: its parameter's slot and its weight 1..n within that sample."""
    cached = plan.layouts.get(present)
    if cached is None:
        sizes = [min(SAMPLES, -(-t.numel() // max(1, t.numel() // SAMPLES))) for t in chosen]
        segment = torch.repeat_interleave(torch.tensor(present), torch.tensor(sizes))
        weight = torch.cat([torch.arange(1, n + 1, dtype=torch.float64) for n in sizes])
        cached = plan.layouts[present] = (segment.to(device), weight.to(device))
    return cached


def _mismatch(plan: _Plan, slots: list[int], high: torch.Tensor,
              low: torch.Tensor, nonfinite: set[int]) -> RankMismatchError:
    """The error for the differing digest ``slots`` (identical on every rank: built from the
    all-reduced values). Weights first: differing weights also make the gradients differ."""
    count = len(plan.params)
    kinds: dict[int, dict[int, tuple[float, float]]] = {}  # kind -> {param index: (lo, hi)}
    odd: set[tuple[int, int]] = set()  # (kind, param index): not finite on some ranks
    for slot in slots:
        part, index = divmod(slot, count)
        lo, hi = float(low[slot]), float(high[slot])
        kind = 0 if part >= 2 else 1 if part == 0 and lo < 0 <= hi else 2
        kinds.setdefault(kind, {}).setdefault(index, (lo, hi))
        if slot in nonfinite:
            odd.add((kind, index))
    for index in kinds.get(1, {}):  # a missing gradient's sample differs too: say it once
        kinds.get(2, {}).pop(index, None)
    kinds = {kind: found for kind, found in kinds.items() if found}
    causes = {0: ("weights", CAUSE_WEIGHT), 1: ("gradient presence", _CAUSE_PRESENCE),
              2: ("gradients", _CAUSE_GRAD)}
    parts = []
    for kind in sorted(kinds):
        what, cause = causes[kind]
        found = sorted(kinds[kind])
        names = ", ".join(f"'{plan.names[i]}'" for i in found[:3])
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        lo, hi = kinds[kind][found[0]]
        spread = "" if kind == 1 else f" (first digest {lo:.6g} .. {hi:.6g} over ranks)"
        if (kind, found[0]) in odd:
            spread = " (NaN or inf on some ranks only)"
        parts.append(f"{what} of {names}{more}{spread}: likely {cause}")
    return RankMismatchError(
        f"optimizer step {plan.steps}: replicated parameters (split along no dimension, so all "
        f"{group_size(plan.group)} TP ranks must hold the same copy) differ across TP ranks "
        "before the step; " + "; ".join(parts)
        + f". Nothing was updated. {ENV}=0 turns this check off (see docs/training.md)")
