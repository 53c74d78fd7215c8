"""Rank function for PEFT imported after the wrap (this module must not import PEFT)."""

from __future__ import annotations

import sys

import pytest

import torchtp

from ._hf_checks import inputs
from ._hf_models import build

# Only the MLP is split: the attention projections stay nn.Linear, so PEFT's
# "all-linear" finds targets and builds adapters that leave the split layers out.
MLP_ONLY = {"model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
            "model.layers.*.mlp.down_proj": "rowwise"}


def peft_imported_after_the_wrap(rank: int, world_size: int) -> list[bool]:
    seen = ["peft" in sys.modules]
    wrapped = torchtp.DistributedModelWrapper(build("llama"), plan=MLP_ONLY)
    seen.append("peft" in sys.modules)  # wrapping a model with no PEFT layer imports no PEFT
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(wrapped.base_model, LoraConfig(r=2, target_modules="all-linear"))
    with pytest.raises(ValueError, match=r"is a PEFT layer built before torchtp's PEFT support "
                       r"was installed \(peft was imported after DistributedModelWrapper.*"
                       r"import peft before wrapping the model"):
        lora(**inputs("llama"))
    return seen
