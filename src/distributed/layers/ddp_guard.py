"""DDP around a tensor-parallel model: exact over a DP group or the TP group, an error otherwise.

``DistributedDataParallel`` broadcasts rank 0's parameters at construction and
averages gradients over its group. Over a DP group (one rank of each TP
group, ``process_group=cfg.dp_group``) that is data parallelism and exact.
Over the TP group itself (plain ``DDP(...)`` when the world is one TP group)
it would overwrite every rank's shards with rank 0's: the split parameters are
left out of DDP (replicated ones are identical on every TP rank, so DDP's
broadcast and averaging keep them exact). Over a group mixing TP peers with
other ranks no choice is right, and DDP's constructor raises, before its
broadcast, on every rank.

This holds for whatever module DDP is given: the wrapper, ``wrapped.base_model``,
a PEFT model around it, any module containing one or inside one. The first
torchtp layer or wrap with tp > 1 calls :func:`install`, which has torch call
:func:`_on_ddp` from inside every later ``DistributedDataParallel.__init__``
(see ``_torch_compat.watch_ddp_construction``). A DDP built before the model
was sharded is refused at its first forward into the model (:func:`check_active_ddp`).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch.distributed as dist
from torch import nn

from ..comm.runtime import ProcessGroup, resolve_group
from ..core import torch_compat as _torch_compat
from ..core.layouts import ParamLayout
from .owned import layouts_of


def install() -> None:
    """Watch every ``DistributedDataParallel`` built from now on (idempotent).

    Called by the first torchtp layer or wrap with tp > 1, never at import:
    until then torchtp changes nothing in torch.
    """
    _torch_compat.watch_ddp_construction(_on_ddp)


# DDP -> the models already found consistent with it (checked once per pair).
_CHECKED: weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[nn.Module]] = \
    weakref.WeakKeyDictionary()


def _on_ddp(ddp: nn.Module, module: nn.Module) -> None:
    names = ignored_by_ddp(module, ddp.process_group)  # type: ignore[arg-type]
    if names:
        _torch_compat.ddp_leave_alone(ddp, module, names)


def check_active_ddp(model: nn.Module) -> None:
    """Refuse a DDP built around ``model`` before it was sharded (before each forward).

    Such a DDP listed its parameters before the wrapper replaced the Linear
    weights (or before PEFT added adapters): its reducer holds the old ones,
    so the new ones would never be averaged (or DDP waits for gradients that
    never come). :mod:`torchtp.guards.forward_door` calls this before every forward of the
    wrapped model, so it finds that DDP the first time its forward calls into
    ``model``; a DDP whose module does not contain ``model`` (a model merely
    called from its forward) is none of its business.

    Raises:
        ValueError: naming the DDP's module, the parameter it misses and the fix.
    """
    ddp = _torch_compat.active_ddp()
    if ddp is None or model in _CHECKED.get(ddp, ()):
        return
    stale = _missed_by(ddp, model)
    if stale is not None:  # raised again at every forward: never trains on silently
        raise ValueError(
            f"DistributedDataParallel around {type(ddp.module).__name__} was built before "
            f"{type(model).__name__} was made tensor-parallel (or before adapters were added): "
            f"its reducer does not hold '{stale}', so DDP would never average it. Build DDP "
            "after DistributedModelWrapper(model) (and after get_peft_model)")
    _CHECKED.setdefault(ddp, weakref.WeakSet()).add(model)


def _missed_by(ddp: Any, model: nn.Module) -> str | None:
    """A trainable parameter of ``model`` (inside ``ddp.module``) that DDP neither averages
    nor was told to leave alone (by torchtp or by the user), else ``None``."""
    if not any(m is model for m in ddp.module.modules()):
        return None  # a model merely called from DDP's forward: DDP does not manage it
    known = {id(p) for p in _torch_compat.ddp_parameters(ddp)}
    known |= {id(p) for n, p in ddp.module.named_parameters(remove_duplicate=False)
              if n in ddp.parameters_to_ignore}
    return next((n for n, p in model.named_parameters()
                 if p.requires_grad and id(p) not in known), None)


def ignored_by_ddp(module: nn.Module, ddp_group: ProcessGroup) -> list[str]:
    """Names (as ``module.named_parameters()`` spells them) DDP over ``ddp_group`` must leave alone.

    Every split parameter of ``module``'s torchtp layers when ``ddp_group``
    holds this rank's TP peers; none over a DP group (one rank per TP group).
    The verdict depends only on the groups' ranks, the same on every rank.

    Raises:
        ValueError: ``ddp_group`` holds TP peers of this rank and other ranks too.
    """
    names: list[str] = []
    verdicts: dict[int, bool] = {}
    for mod_name, mod in module.named_modules():
        split = {attr: lay for attr, lay in layouts_of(mod).items() if lay.dim is not None}
        if not split:
            continue
        tp = getattr(mod, "group", None)
        tp = resolve_group(tp)
        if id(tp) not in verdicts:
            verdicts[id(tp)] = _spans_tp_peers(tp, ddp_group, module, mod_name, split)
        if verdicts[id(tp)]:
            names += [f"{mod_name}.{attr}" if mod_name else attr for attr in split]
    return names


def _spans_tp_peers(tp: ProcessGroup | None, ddp_group: ProcessGroup, module: nn.Module,
                    mod_name: str, split: dict[str, ParamLayout]) -> bool:
    if tp is None or dist.get_world_size(tp) == 1:
        return False
    tp_ranks = set(dist.get_process_group_ranks(tp))
    ddp_ranks = set(dist.get_process_group_ranks(ddp_group))
    if len(tp_ranks & ddp_ranks) <= 1:
        return False  # data parallelism across TP groups
    if ddp_ranks != tp_ranks:
        attr, layout = next(iter(split.items()))
        raise ValueError(
            f"DistributedDataParallel over ranks {sorted(ddp_ranks)} mixes tensor-parallel "
            f"peers {sorted(tp_ranks & ddp_ranks)} (which hold different shards of "
            f"{type(module).__name__}, e.g. '{'.'.join(filter(None, (mod_name, attr)))}' of "
            f"full shape {list(layout.full_shape)} split along dim {layout.dim} "
            f"({'rows' if layout.dim == 0 else 'columns'}) over tp={len(tp_ranks)}) with other "
            "ranks; pass "
            "process_group=torchtp.get_tensor_parallel_config().dp_group "
            "(from init_tensor_parallel(tp_size=...)) so DDP averages across TP groups only")
    return True


def check_fsdp(model: nn.Module, tp: ProcessGroup | None) -> None:
    """Raise if FSDP2 (DTensor parameters) was applied over a mesh that is not exact.

    Checked before a forward whenever the parameter objects changed (FSDP2
    replaces them). Same verdict on every rank: it depends only on the mesh
    layout, which all ranks share. Parameters whose gradient is summed over
    TP ranks need nothing here: :mod:`torchtp.layers.grad_sync` hooks FSDP2's
    unsharded parameters, so the sum happens before FSDP2's reduce-scatter.

    Raises:
        ValueError: the FSDP mesh contains TP peers (it would cut and gather
            different shards as if they were one tensor).
    """
    # Not imported means no DTensor exists; importing it would cost ~1 s (sympy) and
    # as much again at exit, for every user who never applies FSDP2.
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is None:
        return
    meshes = {id(p.device_mesh): p.device_mesh for p in model.parameters()
              if isinstance(p, dtensor)}
    if not meshes or tp is None or dist.get_world_size(tp) == 1:
        return
    tp_ranks = set(dist.get_process_group_ranks(tp))
    for mesh in meshes.values():
        shared = tp_ranks & {int(r) for r in mesh.mesh.flatten().tolist()}
        if len(shared) > 1:
            raise ValueError(
                f"FSDP's mesh {mesh.mesh.tolist()} contains tensor-parallel peers "
                f"{sorted(shared)}, which hold different shards; shard with "
                "fully_shard(module, mesh=cfg.mesh['dp']) from init_tensor_parallel(tp_size=...)")



# Where a model's first parameter sits: its module's parameter dict, its name there, the
# parameter, and the process's module replacements then. Kept by the caller, it tells
# with one dict look-up whether the slot still holds the same object, i.e. whether FSDP2
# may have replaced the parameters since, and with one compare whether a submodule was
# replaced since (the slot would belong to a module no longer in the model).
ParamSlot = tuple[dict[str, nn.Parameter | None], str, nn.Parameter, int]


def check_fsdp_if_new(model: nn.Module, tp: ProcessGroup | None,
                      last: ParamSlot | None) -> ParamSlot | None:
    """Run :func:`check_fsdp` unless nothing changed since ``last``; the slot now.

    The wrapper calls it before a forward once ``last`` no longer holds its
    parameter (FSDP2's ``fully_shard`` replaces parameter objects) or a module
    was replaced since (``model.embed_tokens = new``): a forward where
    neither happened pays no walk over ``model.parameters()``.

    Raises:
        ValueError: as :func:`check_fsdp`; raised again at every forward until fixed.
    """
    named = next(model.named_parameters(), None)
    if named is None:
        return None
    name, param = named
    count = _torch_compat.REPLACEMENTS
    if last is None or param is not last[2] or count != last[3]:
        check_fsdp(model, tp)
    owner, _, leaf = name.rpartition(".")
    return _torch_compat.parameter_slots(model.get_submodule(owner)), leaf, param, count
