"""DDP around a wrapped model: exact over a DP group or the TP group, an error otherwise.

``DistributedDataParallel`` broadcasts rank 0's parameters at construction and
averages gradients over its group. Over a DP group (one rank of each TP
group, ``process_group=cfg.dp_group``) that is data parallelism and exact.
Over the TP group itself (plain ``DDP(wrapped)`` when the world is one TP
group) it would overwrite every rank's shards with rank 0's: the split
parameters are left out of DDP (replicated ones are identical on every TP
rank, so DDP's broadcast and averaging keep them exact). Over a group mixing
TP peers with other ranks no choice is right, and DDP's constructor raises.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from . import _torch_compat
from .clip import layouts_of
from .runtime import ProcessGroup


def ignored_by_ddp(model: nn.Module, tp: ProcessGroup | None, ddp_group: ProcessGroup | None,
                   prefix: str) -> list[str]:
    """Names (under ``prefix``, e.g. ``"base_model"``) DDP over ``ddp_group`` must leave alone.

    Raises:
        ValueError: ``ddp_group`` holds TP peers of this rank and other ranks too.
    """
    if tp is None or ddp_group is None or dist.get_world_size(tp) == 1:
        return []
    tp_ranks = set(dist.get_process_group_ranks(tp))
    ddp_ranks = set(dist.get_process_group_ranks(ddp_group))
    if len(tp_ranks & ddp_ranks) <= 1:
        return []  # data parallelism across TP groups
    if ddp_ranks != tp_ranks:
        raise ValueError(
            f"DistributedDataParallel over ranks {sorted(ddp_ranks)} mixes tensor-parallel "
            f"peers {sorted(tp_ranks & ddp_ranks)} (which hold different shards) with other "
            "ranks; pass process_group=torchtp.get_tensor_parallel_config().dp_group "
            "(from init_tensor_parallel(tp_size=...)) so DDP averages across TP groups only")
    return [".".join(filter(None, (prefix, mod_name, attr)))
            for mod_name, mod in model.named_modules() for attr, layout in layouts_of(mod).items()
            if layout.dim is not None]


def check_fsdp(model: nn.Module, tp: ProcessGroup | None) -> None:
    """Raise if FSDP2 (DTensor parameters) was applied over a mesh that is not exact.

    Checked before a forward whenever the parameter objects changed (FSDP2
    replaces them). Same verdict on every rank: it depends only on the mesh
    layout, which all ranks share. Parameters whose gradient is summed over
    TP ranks need nothing here: :mod:`torchtp.grad_sync` hooks FSDP2's
    unsharded parameters, so the sum happens before FSDP2's reduce-scatter.

    Raises:
        ValueError: the FSDP mesh contains TP peers (it would cut and gather
            different shards as if they were one tensor).
    """
    from torch.distributed.tensor import DTensor

    meshes = {id(p.device_mesh): p.device_mesh for p in model.parameters()
              if isinstance(p, DTensor)}
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


def check_enclosing_ddp(wrapper: nn.Module, model: nn.Module, tp: ProcessGroup | None) -> None:
    """Raise if a DDP around a module *containing* ``wrapper`` spans TP peers unguarded.

    Only a DDP that wraps the wrapper itself asks it which parameters to
    leave alone; one around a larger module broadcast rank 0's shards into
    every TP rank at construction and averages different shards. Called at
    the first training forward (DDP's forward is then on the stack); the
    verdict depends on the module tree and the groups, the same on every rank.

    Raises:
        ValueError: naming the DDP's module, the wrapper's path and the fix.
    """
    for ddp in _torch_compat.enclosing_ddps():
        if ddp.module is wrapper:
            continue  # asked the wrapper at construction (ignored_by_ddp)
        path = next((name for name, mod in ddp.module.named_modules() if mod is wrapper), None)
        if path is None:
            continue
        prefix = f"{path}.base_model" if path else "base_model"
        needed = ignored_by_ddp(model, tp, ddp.process_group, prefix)
        missing = [name for name in needed if name not in ddp.parameters_to_ignore]
        if missing:
            raise ValueError(
                f"DistributedDataParallel wraps {type(ddp.module).__name__}, which contains a "
                f"tensor-parallel model at '{path}', over ranks that are its TP peers: DDP "
                f"broadcast rank 0's shards (e.g. '{missing[0]}', split over "
                f"tp={dist.get_world_size(tp)}) into every rank at construction and would "
                "average different shards. Wrap the DistributedModelWrapper itself in DDP "
                "(it tells DDP to leave its split parameters alone), or use "
                "process_group=cfg.dp_group from init_tensor_parallel(tp_size=...)")
