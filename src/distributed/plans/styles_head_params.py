"""An attention module's own per-head parameters, cut with its heads (``local_params``).

Some attention modules hold a bare parameter of one value per query head that
their forward reads beside the projections: GPT-OSS's, Granite-SWA's and
MiMo-V2-Flash's attention ``sinks``, Beam's ``gate_bias``. When torchtp splits
the module's heads, each rank's forward runs its own heads only, so such a
parameter keeps this rank's heads' values (the same rule as the projections,
:func:`torchtp.core.layouts.head_share`): a split parameter, its gradient local,
its layout recorded for checkpoints. HuggingFace names this ``local_params`` on
the attention module (with ``"<attention>.sinks": "colwise"`` beside it); a plan
that splits the heads without it gets it all the same, since the module's
forward could not run its local heads against every head's values.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.layouts import ParamLayout
from ..layers.owned import hold_shards
from .heads import HeadInfo, query_part
from .styles import LayerPlan, ParallelStyle, ShardContext


def head_parameters(module: nn.Module, info: HeadInfo) -> list[str]:
    """Names of ``module``'s own 1-D parameters with one value per query head."""
    return [name for name, p in module.named_parameters(recurse=False)
            if p.dim() == 1 and p.shape[0] == info.heads]


class HeadParams(ParallelStyle):
    """Cut an attention module's per-head parameters to this rank's query heads.

    Without head geometry (HF's ``local_params`` on a module whose heads stay
    whole) it keeps the module as it is; the head split gives it the geometry
    (:func:`torchtp.plans.head_split.split_whole_heads`, the automatic plan).

    Args:
        info: The module's head geometry, or ``None`` while its heads are not split.
    """

    name = "local_params"
    covers = ("*",)  # HF names the per-head parameter beside it ("<attention>.sinks": "colwise")

    def __init__(self, info: HeadInfo | None = None) -> None:
        self.info = info

    def plan(self, module: nn.Module, fqn: str, ctx: ShardContext) -> LayerPlan:
        if self.info is None:
            return LayerPlan(fqn, self.name)
        names = head_parameters(module, self.info)
        part = query_part(self.info)
        first, count = part.unit_range(ctx)  # this rank's query heads
        layouts = {n: ParamLayout((self.info.heads,), 0, ((first, count),)) for n in names}
        return LayerPlan(fqn, self.name, full=(self.info.heads,), local=(count,),
                         layouts=layouts if ctx.world_size > 1 else {},
                         detail=f"{count} of {self.info.heads} heads")

    def apply(self, module: nn.Module, layer: LayerPlan, ctx: ShardContext) -> nn.Module:
        if ctx.world_size == 1 or not layer.layouts:
            return module
        return hold_shards(module, dict(layer.layouts))


def local_head_parameters(module: nn.Module, info: HeadInfo, ctx: ShardContext
                          ) -> dict[str, torch.Tensor]:
    """This rank's cut of each per-head parameter (for the plan probes, which run the
    module's forward with its heads local before anything is cut)."""
    first, count = query_part(info).unit_range(ctx)
    return {n: getattr(module, n).narrow(0, first, count) for n in head_parameters(module, info)}
