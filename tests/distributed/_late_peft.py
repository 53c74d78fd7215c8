"""Rank function for PEFT imported after the wrap (this module must not import PEFT)."""

from __future__ import annotations

import sys

import torch

import torchtp

from ._hf_checks import inputs, loss_of
from ._hf_models import build

# fp32, a few AdamW steps: see test_peft's CLOSE.
CLOSE = {"rtol": 1e-4, "atol": 1e-5}


def peft_imported_after_the_wrap(rank: int, world_size: int) -> list[object]:
    """Wrap, then ``import peft`` and ``get_peft_model`` on the wrapped model, with explicit
    targets (PEFT's own error before) and ``"all-linear"`` (it left torchtp's layers out):
    the adapters sit on torchtp's layers and train exactly as the unsharded LoRA model."""
    seen: list[object] = ["peft" in sys.modules]
    wrapped = {t: torchtp.DistributedModelWrapper(build("llama")) for t in ("names", "all")}
    seen.append("peft" in sys.modules)  # wrapping a model with no PEFT layer imports no PEFT
    from peft import LoraConfig, get_peft_model

    batch = inputs("llama")
    for key, targets in (("names", ["q_proj", "v_proj", "down_proj"]), ("all", "all-linear")):
        config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights="gaussian")
        base = build("llama")  # seeds itself: built before the adapters' seed
        torch.manual_seed(5)
        ref = get_peft_model(base, config)
        torch.manual_seed(5)
        tp = get_peft_model(wrapped[key].base_model, config)
        bases = {type(m.get_base_layer()).__name__ for m in tp.modules() if hasattr(m, "lora_A")}
        seen.append(sorted(bases))
        opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
                for m in (ref, tp)]
        for model, opt in zip((ref, tp), opts, strict=True):
            loss_of(model, batch).backward()
            opt.step()
        torch.testing.assert_close(tp(**batch).logits, ref(**batch).logits, **CLOSE)
    return seen
