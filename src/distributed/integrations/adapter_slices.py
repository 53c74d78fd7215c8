"""This rank's slices of PEFT adapter factors, and the LoRA options torchtp can shard.

Shared by the LoRA layers around torchtp's Linears (``integrations/peft.py``)
and around split parameters (``integrations/peft_params.py``): an
adapter factor PEFT built at full size keeps this rank's slice
(:func:`keep_slice`) and records its layout, so savers, clipping and
checkpoints treat it as split, and a full-size tensor loaded into it keeps
the slice too.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..core.layouts import ParamLayout
from ..layers.owned import ShardedModule, accept_full_size

# Initialisations PEFT draws without reading the base weight (PiSSA, OLoRA,
# LoftQ, EVA... decompose the full base weight, which no rank holds).
_PLAIN_INITS = (True, False, "gaussian")


def check_supported(layer: Any, config: Any) -> None:
    """Refuse LoRA options whose sharding torchtp does not implement."""
    who = f"LoRA on {type(layer.get_base_layer()).__name__}"
    if getattr(config, "lora_bias", False):
        raise ValueError(f"{who}: lora_bias=True is not supported under tensor parallelism; "
                         "set lora_bias=False")
    if layer.resolve_lora_variant(config=config) is not None:
        raise ValueError(f"{who}: LoRA variants (DoRA, aLoRA, VeLoRA, ...) are not supported "
                         "under tensor parallelism; use plain LoRA")
    init = getattr(config, "init_lora_weights", True)
    if init not in _PLAIN_INITS:
        raise ValueError(f"{who}: init_lora_weights={init!r} reads the full base weight, which "
                         f"no rank holds; use one of {list(_PLAIN_INITS)}, or create the "
                         "adapter on the unsharded model and wrap the PeftModel afterwards")


class AdapterSlice(nn.Linear, ShardedModule):
    """A LoRA ``A`` or ``B`` matrix that holds this rank's slice; its layout says which.

    Same forward and state-dict names as the ``nn.Linear`` PEFT made; owning a
    layout makes savers, clipping and checkpoints treat it as split.
    """


def keep_slice(linear: nn.Linear, layout: ParamLayout) -> None:
    """Make ``linear`` (a full-size factor PEFT built) an :class:`AdapterSlice` holding
    ``layout``'s slice of its weight."""
    weight = linear.weight
    linear.weight = nn.Parameter(layout.take(weight.detach()), requires_grad=weight.requires_grad)
    linear.out_features, linear.in_features = linear.weight.shape
    linear.__class__ = AdapterSlice  # no new state: the layout below is all it adds
    assert isinstance(linear, AdapterSlice)
    linear.tp_layouts = {"weight": layout}
    accept_full_size(linear)  # a full-size adapter tensor loaded keeps this rank's slice
