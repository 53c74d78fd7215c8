"""A ``torch.amp.GradScaler`` whose skip decision is the whole model's.

``torch.amp.GradScaler`` skips ``optimizer.step()`` (and lowers its scale) on a
rank whose own gradients hold an inf or NaN. Under tensor parallelism each rank
holds other shards: an overflow in one rank's shard skips the step there and
steps everywhere else, the replicated weights part, and the scales too. Here
the ranks agree first: one all-reduce (max) of the found-inf flag after
``unscale_``, so every rank skips or steps together, as one process would.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState

from ..comm import ops as _comm
from ..comm.runtime import ProcessGroup
from ..core import torch_compat as _torch_compat


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for tensor-parallel models: the same arguments, plus ``group``.

    Skips a step on every rank when any rank's gradients (its shards) are not
    finite, and keeps one scale everywhere. Use it as torch's::

        scaler = torchtp.GradScaler("cuda")
        scaler.scale(loss).backward()
        scaler.unscale_(opt)                      # optional: before clipping
        torchtp.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()

    Args:
        device: As ``torch.amp.GradScaler``.
        *args: As ``torch.amp.GradScaler``.
        group: The ranks that agree (every rank calls ``unscale_``/``step`` alike);
            ``None``: the world, which covers the TP group, data parallelism (FSDP2's
            shards) and pipeline stages.
        **kwargs: As ``torch.amp.GradScaler``.
    """

    def __init__(self, device: str = "cuda", *args: Any, group: ProcessGroup | None = None,
                 **kwargs: Any) -> None:
        super().__init__(device, *args, **kwargs)
        self.group = group

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """``torch.amp.GradScaler.unscale_``, then the found-inf flags agreed across ``group``.

        Collective over ``group`` (one all-reduce of one value), once per step.
        """
        super().unscale_(optimizer)
        if self.is_enabled() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            found = _torch_compat.grad_scaler_state(self, optimizer)["found_inf_per_device"]
            flags = list(found.values())  # 0-dim float32 each: > 0 where it saw an inf/NaN
            # No flag (no gradient here): torch's step raises on this rank after the agreement
            mine = (torch.stack([f.to(flags[0].device) for f in flags]).amax() if flags
                    else torch.zeros(()))
            anywhere = _comm.all_reduce(mine.reshape(1), self.group, "max")
            for flag in flags:
                flag.copy_(anywhere.to(flag.device).reshape(flag.shape))

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``torch.amp.GradScaler.step`` after an agreed :meth:`unscale_` (optimizers that
        unscale inside their fused step included)."""
        if self.is_enabled() and (
                _torch_compat.grad_scaler_state(self, optimizer)["stage"] is OptState.READY):
            self.unscale_(optimizer)
        return super().step(optimizer, *args, **kwargs)
