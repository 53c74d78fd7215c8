"""Every checkpoint tensor of a (wrapped) model: its name, owners and layout.

Parallel layers own the layouts of their parameters (read with
:func:`torchtp.layers.layouts_of`, see :mod:`torchtp.core.layouts`); every other
parameter and every persistent buffer is replicated. Tied parameters
(one Parameter object under several names) become one entry whose first
name is the checkpoint name and whose other names are aliases, as HF saves
them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..core.layouts import ParamLayout, replicated
from ..core.torch_compat import persistent_buffers
from ..layers import layouts_of


@dataclass
class Placement:
    """One checkpoint tensor as this rank holds it."""

    name: str
    tensor: torch.Tensor
    layout: ParamLayout
    is_param: bool
    owners: list[tuple[str, str]] = field(default_factory=list)  # (module name, attribute)

    @property
    def aliases(self) -> list[str]:
        """Other checkpoint names of the same (tied) tensor."""
        return [_join(m, a) for m, a in self.owners[1:]]

    @property
    def names(self) -> list[str]:
        return [_join(m, a) for m, a in self.owners]


def _join(module: str, attr: str) -> str:
    return f"{module}.{attr}" if module else attr


def placements(model: nn.Module) -> list[Placement]:
    """The model's checkpoint tensors in module order (parameters, then persistent buffers)."""
    by_id: dict[int, Placement] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        layouts = layouts_of(mod)
        for attr, p in mod.named_parameters(recurse=False):
            _add(by_id, mod_name, attr, p, layouts.get(attr), True)
        for attr, b in persistent_buffers(mod):
            _add(by_id, mod_name, attr, b, None, False)
    return list(by_id.values())


def _add(by_id: dict[int, Placement], mod_name: str, attr: str, t: torch.Tensor,
         layout: ParamLayout | None, is_param: bool) -> None:
    if id(t) in by_id:
        if (mod_name, attr) not in by_id[id(t)].owners:
            by_id[id(t)].owners.append((mod_name, attr))
        return
    by_id[id(t)] = Placement(_join(mod_name, attr), t, layout or replicated(t.shape), is_param,
                             [(mod_name, attr)])


def checkpoint_local(p: Placement) -> torch.Tensor:
    """This rank's tensor in checkpoint orientation (Conv1D shards transposed back)."""
    t = p.tensor.detach()
    return t.t() if p.layout.transposed else t
